"""The pool's page checksums as Triton kernels (GPU only; `pool.KVPool` elsewhere): the pages
touched between steps, and the incremental watch's checks (`watch.IncrementalWatch`).

Why: between steps the replay re-sums the pages the last step's rewind and this step's block
events touched: index_select + sum + index_copy_ in torch, 30 µs of host on the H200's host,
13 µs as one launch here (.whl/probe6.py, round 3). Same bits: page sums of the raw 64-bit
words modulo 2^64 (integer addition wraps, so any order gives torch's sum).

Measured and not kept (same probe): a Triton NaN fill for the poison (11.5 µs of host per call
against index_fill_'s 7.3; index_fill_ never synchronizes, its "150 µs" in the round-2 profile
was the profiler's one-time CUPTI buffer request, ~2 ms, counted inside the first call), and the
full checksum with the change flags in one launch (24.9 µs against sum + ne's 19.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_backend.tlaunch import Launcher


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


@triton.jit(do_not_specialize=["step", "nt", "check"])
def _resum_pre_kernel(WORDS, TOUCHED, nt, IDX, check, SUMS, PRE, STAMP, FLAG, step,
                      W: tl.constexpr, BLOCK: tl.constexpr):
    """Programs [0, nt): the pages the step's events touched, re-summed; the rest: its target
    pages, summed before its kernels, the first `check` of them (none touched, so no program
    of this launch writes their expected sums) checked against their expected sums."""
    i = tl.program_id(0)
    if i < nt:
        page = tl.load(TOUCHED + i)
        tl.store(SUMS + page, _page_sum(WORDS, page, W, BLOCK))
    else:
        j = i - nt
        page = tl.load(IDX + j)
        s = _page_sum(WORDS, page, W, BLOCK)
        tl.store(PRE + page, s)
        tl.store(STAMP + page, step)
        if j < check:
            tl.store(FLAG, 1, mask=s != tl.load(SUMS + page))


@triton.jit(do_not_specialize=["step", "n"])
def _post_kernel(WORDS, IDX, n, AHEAD, SUMS, PRE, STAMP, MOVED, FLAG, step, W: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Programs [0, n): the step's targets (moved, new expected sum); the rest: pages the next
    step's events touch, checked unless they were this step's targets (their sums are being
    rewritten by the first programs: STAMP says which, written by _resum_pre_kernel's
    launch)."""
    i = tl.program_id(0)
    if i < n:
        page = tl.load(IDX + i)
        s = _page_sum(WORDS, page, W, BLOCK)
        tl.store(MOVED + i, (s != tl.load(PRE + page)).to(tl.int8))
        tl.store(SUMS + page, s)
    else:
        page = tl.load(AHEAD + i - n)
        if tl.load(STAMP + page) != step:
            s = _page_sum(WORDS, page, W, BLOCK)
            tl.store(FLAG, 1, mask=s != tl.load(SUMS + page))


_resum_pre = Launcher(_resum_pre_kernel, num_warps=8)
_post = Launcher(_post_kernel, num_warps=8)


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
