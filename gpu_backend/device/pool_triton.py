"""Triton launches with less host work per call (GPU only).

Why: the replay step is host-bound (docs/gpu.md), and `kernel[grid](...)` (JITFunction.run)
spends tens of µs of Python per launch on a slow host: knob and environment reads, binding and
specializing every argument, `str(options)` for the cache key, launch-metadata hooks. A step
launches several Triton kernels.

`Launcher` keeps, per specialization, the compiled kernel that the first ordinary launch returns,
and later launches call its launcher directly. The key holds every property Triton specializes
on (tensor dtype and 16-byte alignment; int == 1, int % 16 == 0, int width; the current device),
so two launches with one key run the same compiled code Triton would pick.

The pool's page checksums as Triton kernels (GPU only; `pool.KVPool` elsewhere): the pages
touched between steps, and the incremental watch's checks (`watch.IncrementalWatch`).

Why: between steps the replay re-sums the pages the last step's rewind and this step's block
events touched: index_select + sum + index_copy_ in torch, 30 µs of host on the H200's host,
13 µs as one launch here. Same bits: page sums of the raw 64-bit
words modulo 2^64 (integer addition wraps, so any order gives torch's sum).

Measured and not kept: a Triton NaN fill for the poison (11.5 µs of host per call
against index_fill_'s 7.3; index_fill_ never synchronizes, its "150 µs" in a profile
was the profiler's one-time CUPTI buffer request, ~2 ms, counted inside the first call), and the
full checksum with the change flags in one launch (24.9 µs against sum + ne's 19.0).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_T = torch.Tensor


def _key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`_arg_key` of every argument, the common classes inline (half the host time)."""
    return tuple([(a.dtype, a.data_ptr() & 15 == 0) if a.__class__ is _T else
                  (a & 15 == 0, a == 1, -(1 << 31) <= a < (1 << 31), a >= 1 << 63)
                  if a.__class__ is int else
                  _arg_key(a) for a in args])


def _arg_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return (a % 16 == 0, a == 1, -(1 << 31) <= a < (1 << 31), a >= 1 << 63)
    if isinstance(a, float):
        return "f"
    return ("v", a)  # None, strings: part of the signature as Triton sees them


class Launcher:
    """`Launcher(kernel, num_warps=4)(grid, *args, **constexprs)` == kernel[grid](*args,
    **constexprs, num_warps=4). Positional args are the kernel's non-constexpr parameters, in
    order; constexprs go by keyword (every one of them, no defaults)."""

    def __init__(self, fn: Any, **options: Any):
        self.fn, self.options = fn, options
        # the launcher's order; no params: Triton's interpreter (TRITON_INTERPRET=1), no direct
        self.cnames = [p.name for p in getattr(fn, "params", ()) if p.is_constexpr]
        self.direct = hasattr(fn, "params")
        self.cache: dict[Any, Any] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any, **const: Any) -> None:
        if not self.direct:
            self.fn[grid](*args, **const, **self.options)
            return
        dev = torch.cuda.current_device()
        key = (dev, tuple(const.items()), _key(args))
        ck = self.cache.get(key)
        if ck is None:
            ck = self.fn[grid](*args, **const, **self.options)
            self.cache[key] = ck.result() if hasattr(ck, "result") else ck
            return
        g = (*grid, 1, 1)
        # the launcher takes every parameter in order, constexprs too (it skips them)
        ck.run(g[0], g[1], g[2], _stream(dev), ck.function, ck.packed_metadata, None, None,
               None, *args, *[const[n] for n in self.cnames])


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's driver calls


def _stream(dev: int) -> int:
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(dev))
    return int(torch.cuda.current_stream(dev).cuda_stream)


@triton.jit
def _page_sum(WORDS, page, W: tl.constexpr, BLOCK: tl.constexpr):
    base = WORDS + page * W
    acc = tl.zeros([BLOCK], tl.int64)
    for w0 in range(0, W, BLOCK):
        j = w0 + tl.arange(0, BLOCK)
        acc += tl.load(base + j, mask=j < W, other=0)
    return tl.sum(acc, 0)


@triton.jit
def _page_sums_kernel(WORDS, IDX, OUT, W: tl.constexpr, BLOCK: tl.constexpr):
    page = tl.load(IDX + tl.program_id(0))
    tl.store(OUT + page, _page_sum(WORDS, page, W, BLOCK))


_sums = Launcher(_page_sums_kernel, num_warps=8)


def _block(W: int) -> int:
    return min(triton.next_power_of_2(W), 2048)


def resum(words: torch.Tensor, sums: torch.Tensor, idx: torch.Tensor) -> None:
    """sums[idx] = the sums of pages idx (words: the pool as int64 [pages, W])."""
    W = int(words.shape[1])
    if idx.numel():
        _sums((int(idx.numel()),), words, idx, sums, W=W, BLOCK=_block(W))


@triton.jit
def _resum_one(WORDS, TOUCHED, i, SUMS, W: tl.constexpr, BLOCK: tl.constexpr):
    """A page the step's events touched: its expected sum is its sum now."""
    page = tl.load(TOUCHED + i)
    tl.store(SUMS + page, _page_sum(WORDS, page, W, BLOCK))


@triton.jit
def _pre_one(WORDS, IDX, j, check, SUMS, PRE, STAMP, FLAG, step, W: tl.constexpr,
             BLOCK: tl.constexpr):
    """Target j before the kernels: its sum, stamped with the step; the first `check` targets
    (none touched, so no program of this launch writes their expected sums) checked against
    their expected sums."""
    page = tl.load(IDX + j)
    s = _page_sum(WORDS, page, W, BLOCK)
    tl.store(PRE + page, s)
    tl.store(STAMP + page, step)
    if j < check:
        tl.store(FLAG, 1, mask=s != tl.load(SUMS + page))


@triton.jit
def _post_one(WORDS, IDX, i, SUMS, PRE, MOVED, W: tl.constexpr, BLOCK: tl.constexpr):
    """Target i after the kernels: moved, and its new expected sum."""
    page = tl.load(IDX + i)
    s = _page_sum(WORDS, page, W, BLOCK)
    tl.store(MOVED + i, (s != tl.load(PRE + page)).to(tl.int8))
    tl.store(SUMS + page, s)


@triton.jit
def _ahead_one(WORDS, AHEAD, i, SUMS, STAMP, FLAG, step, W: tl.constexpr, BLOCK: tl.constexpr):
    """A page the next events touch, checked unless it was a target of `step` (its expected sum
    is that step's `_post_one`'s: STAMP says which, written by `_pre_one`)."""
    page = tl.load(AHEAD + i)
    if tl.load(STAMP + page) != step:
        s = _page_sum(WORDS, page, W, BLOCK)
        tl.store(FLAG, 1, mask=s != tl.load(SUMS + page))


@triton.jit(do_not_specialize=["step", "nt", "check"])
def _resum_pre_kernel(WORDS, TOUCHED, nt, IDX, check, SUMS, PRE, STAMP, FLAG, step,
                      W: tl.constexpr, BLOCK: tl.constexpr):
    """Programs [0, nt): the pages the step's events touched, re-summed; the rest: its target
    pages before its kernels (`_pre_one`)."""
    i = tl.program_id(0)
    if i < nt:
        _resum_one(WORDS, TOUCHED, i, SUMS, W, BLOCK)
    else:
        _pre_one(WORDS, IDX, i - nt, check, SUMS, PRE, STAMP, FLAG, step, W, BLOCK)


@triton.jit(do_not_specialize=["step", "n"])
def _post_kernel(WORDS, IDX, n, AHEAD, SUMS, PRE, STAMP, MOVED, FLAG, step, W: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Programs [0, n): the step's targets (`_post_one`); the rest: pages the next step's events
    touch (`_ahead_one`)."""
    i = tl.program_id(0)
    if i < n:
        _post_one(WORDS, IDX, i, SUMS, PRE, MOVED, W, BLOCK)
    else:
        _ahead_one(WORDS, AHEAD, i - n, SUMS, STAMP, FLAG, step, W, BLOCK)


# The same checks inside a CUDA graph (`gpu_backend.device.graphs`): the counts and step numbers
# come
# from the step's block on the device (PARAMS: nt, n, check, step, previous step, poisoned
# rows), the grids from the graph's capacities; programs past a count do nothing.
@triton.jit
def _g_ahead_kernel(WORDS, PARAMS, TOUCHED, SUMS, STAMP, FLAG, W: tl.constexpr,
                    BLOCK: tl.constexpr):
    """The previous step's check of the pages this step's events touch, before they do."""
    i = tl.program_id(0)
    if i < tl.load(PARAMS):
        _ahead_one(WORDS, TOUCHED, i, SUMS, STAMP, FLAG, tl.load(PARAMS + 4), W, BLOCK)


@triton.jit
def _g_poison_kernel(ROWS, PARAMS, IDX, RW: tl.constexpr, BLOCK: tl.constexpr,
                     NAN: tl.constexpr):
    """`KVPool.poison_rows`: rows IDX[i] of the pool as 16-bit words [rows, RW] set to NAN, the
    bits index_fill_ writes (a float NaN cast in the kernel could be another NaN)."""
    i = tl.program_id(0)
    if i < tl.load(PARAMS + 5):
        base = ROWS + tl.load(IDX + i) * RW
        for c0 in range(0, RW, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            tl.store(base + c, tl.full([BLOCK], NAN, tl.int16), mask=c < RW)


@triton.jit
def _g_pre_kernel(WORDS, PARAMS, TOUCHED, IDX, cap_t, SUMS, PRE, STAMP, FLAG,
                  W: tl.constexpr, BLOCK: tl.constexpr):
    """`_resum_pre_kernel` with the touched pages' programs [0, cap_t)."""
    i = tl.program_id(0)
    if i < cap_t:
        if i < tl.load(PARAMS):
            _resum_one(WORDS, TOUCHED, i, SUMS, W, BLOCK)
    elif i - cap_t < tl.load(PARAMS + 1):
        _pre_one(WORDS, IDX, i - cap_t, tl.load(PARAMS + 2), SUMS, PRE, STAMP, FLAG,
                 tl.load(PARAMS + 3), W, BLOCK)


@triton.jit
def _g_post_kernel(WORDS, PARAMS, IDX, SUMS, PRE, MOVED, W: tl.constexpr, BLOCK: tl.constexpr):
    """`_post_kernel`'s targets (the next events' pages: the next step's `_g_ahead_kernel`)."""
    i = tl.program_id(0)
    if i < tl.load(PARAMS + 1):
        _post_one(WORDS, IDX, i, SUMS, PRE, MOVED, W, BLOCK)


_resum_pre = Launcher(_resum_pre_kernel, num_warps=8)
_post = Launcher(_post_kernel, num_warps=8)
_g_ahead = Launcher(_g_ahead_kernel, num_warps=8)
_g_poison = Launcher(_g_poison_kernel, num_warps=4)
_g_pre = Launcher(_g_pre_kernel, num_warps=8)
_g_post = Launcher(_g_post_kernel, num_warps=8)


def resum_pre(words: torch.Tensor, touched: torch.Tensor | None, idx: torch.Tensor | None,
              check: int, sums: torch.Tensor, pre: torch.Tensor, stamp: torch.Tensor,
              flag: torch.Tensor, step: int) -> None:
    """`KVPool.resum_pre` in one launch."""
    nt = 0 if touched is None else int(touched.numel())
    n = 0 if idx is None else int(idx.numel())
    if nt + n:
        W = int(words.shape[1])
        _resum_pre((nt + n,), words, sums if touched is None else touched, nt,
                   sums if idx is None else idx, check, sums, pre, stamp, flag, step, W=W,
                   BLOCK=_block(W))


def post_check(words: torch.Tensor, idx: torch.Tensor | None, ahead: torch.Tensor | None,
               sums: torch.Tensor, pre: torch.Tensor, stamp: torch.Tensor, flag: torch.Tensor,
               step: int) -> torch.Tensor:
    """`KVPool.post_check` in one launch: the moved flags of idx, bool."""
    n = 0 if idx is None else int(idx.numel())
    m = 0 if ahead is None else int(ahead.numel())
    moved = torch.empty(n, dtype=torch.int8, device=flag.device)
    if n + m:
        _post((n + m,), words, sums if idx is None else idx, n, sums if ahead is None else ahead,
              sums, pre, stamp, moved, flag, step, W=int(words.shape[1]),
              BLOCK=_block(int(words.shape[1])))
    return moved.view(torch.bool)


def graph_events(words: torch.Tensor, rows: torch.Tensor, params: torch.Tensor,
                 touched: torch.Tensor, prows: torch.Tensor, sums: torch.Tensor,
                 stamp: torch.Tensor, flag: torch.Tensor) -> None:
    """In a graph, before a step's kernels: the previous step's check of the pages the events
    touch, then the events' poison (rows: the pool as [rows, H_kv * D], 16-bit floats)."""
    W, RW = int(words.shape[1]), int(rows.shape[1])
    _g_ahead((int(touched.numel()),), words, params, touched, sums, stamp, flag, W=W,
             BLOCK=_block(W))
    nan = int(torch.full((), float("nan"), dtype=rows.dtype).view(torch.int16).item())
    _g_poison((int(prows.numel()),), rows.view(torch.int16), params, prows, RW=RW,
              BLOCK=min(triton.next_power_of_2(RW), 1024), NAN=nan)


def graph_pre(words: torch.Tensor, params: torch.Tensor, touched: torch.Tensor,
              idx: torch.Tensor, sums: torch.Tensor, pre: torch.Tensor, stamp: torch.Tensor,
              flag: torch.Tensor) -> None:
    """`resum_pre` in a graph: counts and step from params."""
    W, nt = int(words.shape[1]), int(touched.numel())
    _g_pre((nt + int(idx.numel()),), words, params, touched, idx, nt, sums, pre, stamp, flag,
           W=W, BLOCK=_block(W))


def graph_post(words: torch.Tensor, params: torch.Tensor, idx: torch.Tensor,
               sums: torch.Tensor, pre: torch.Tensor, moved: torch.Tensor) -> None:
    """`post_check`'s targets in a graph, moved flags into `moved` (int8, len(idx))."""
    W = int(words.shape[1])
    _g_post((int(idx.numel()),), words, params, idx, sums, pre, moved, W=W, BLOCK=_block(W))
