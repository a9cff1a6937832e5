"""Device-to-device copies by address, through the CUDA driver (`cuMemcpyDtoDAsync`).

Why: a graph step (`gpu_backend.device.graphs`) copies its block in and its results out, and through
torch those cost the loop ~100 µs of host a step on the H200 (the block's
view 17-19 and copy_ 32-33, the results' clone 22-31 and its four views 27-28). Here a copy is
one call into the driver: a step's three took 22-24 µs. The addresses are the tensors' own,
queued on the replay's stream where torch's copy would have been, so the caching allocator's
stream-ordered reuse holds as it does for torch's copies.

A CUDA graph step's results in the loop's device arena (`graphs.StepGraphs.run`), as the
read-back finds them (`verdicts`).

Why: a tensor of its own for each step's results, and views of it, cost the loop ~20 µs of the
H200's host a step; a copy by address into an arena none of that (`graphs.run`
12.4-19.6 against 21.6-29.4 ms over a 256-step 64 x 2k replay).

A steady step's device work as one CUDA graph: events, page checks, content, append,
attention, reference, token errors.

Why: at batch 64 x kv 2k the step's kernels take ~0.15 ms of device time, and the host took
0.6-1.4 ms to queue them eagerly (~13 launches, FlashInfer's Python
plan() and run(), and the Python between them): the replay was host-bound at 4-8x the kernels'
time. Here such a step costs the host a copy in, one graph launch and a copy out of its results.

Which steps: the steady state of a speculative-decoding trace, one FA2 launch over every row
with one query width W (verify rows), content and truth at the same positions, the reference one
batched group (`batch.RefGroup.identity`), no prefix fills, no RoPE overrun, no stale plan, no
slot copies among the block events. `prepare` stages such a step's inputs one after the other
(`block`), so the step's copy into the static buffers is two copies (the chunk's int64 and int32
twins). The variable-length ones (the pages the events touch, the pages the appends target, the
poisoned rows) are padded to capacities that only grow within a replay (`HostState.graph_caps`),
so a replay captures a few graphs, not one per step.

With the incremental page watch (`watch.IncrementalWatch`) the graph also holds the block events'
poison and the watch's checks (`pool_triton.graph_events`, `graph_pre`, `graph_post`, the same
`_page_sum` and per-page steps as the eager kernels, counts read from the step's block). One
check moves: the previous step's look at the pages this step's events touch runs at the start
of this step's graph (before the events, as before); an eager step after a graph step does it
itself (`IncrementalWatch.before_events`). With the full watch the events and the checksum stay
eager around the graph.

What is the same as the eager step: every kernel (the content and reference Triton kernels,
FlashInfer's append and FA2 paged prefill), its inputs and its order; the FA2 kernel is planned
per step in FlashInfer's CUDA-graph mode (scheduler.cuh `PrefillPlan`: a fixed grid, always
split over the kv, `uniform_q_len` tiles), the way SGLang and vLLM replay it. The plan is made
by the preparation (`gpu_backend.host.graph_block`, FlashInfer's planner ported) and staged in the
block;
the wrapper's int workspace is that field of the int32 twin, so the graph's conversion of the
block writes the plan where the kernels read it: the loop calls no planner a step.
A key's first step plans through FlashInfer's own plan() and checks the port against it (plan
info and bytes); a key whose plan differs runs eagerly (`stats()['plan_mismatches']`).
The reference gets the truth store's span as its key bound instead of the step's longest row:
it stops at each row's own last limit either way (`reference_triton._attend_kernel`), so the bits
match.
What differs: FA2's split-kv merge order (rounding within the tolerance), and FlashInfer's
Python checks in plan()/run(), which run once per shape at capture instead of every step.

A step that FlashInfer's checks refuse at capture, or whose page counts the planner would
refuse, runs eagerly (`stats()['eager_fallbacks']`, or no key).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from gpu_backend.device.pool import content_kv_q
from gpu_backend.device.reference import beside, join, unwritten
from gpu_backend.device.watch import IncrementalWatch
from gpu_backend.host import graph_block
from gpu_backend.host.graph_block import _FIELDS, Key, offsets
from gpu_backend.host.staging import HOST32


@cache
def _driver() -> Callable[[int, int, int, int], int]:
    f = ctypes.CDLL("libcuda.so.1").cuMemcpyDtoDAsync_v2
    f.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f  # type: ignore[no-any-return]


def d2d(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    """Queue a copy of nbytes from device address src to dst on `stream` (no wait)."""
    if nbytes <= 0:
        return
    rc = _driver()(dst, src, nbytes, stream.cuda_stream)
    if rc:
        raise RuntimeError(f"cuMemcpyDtoDAsync failed: CUDA driver error {rc}")


def into(dst: torch.Tensor, src: torch.Tensor, offset: int, stream: torch.cuda.Stream
         ) -> torch.Tensor:
    """dst's bytes from src's, starting `offset` bytes into src (both on the device, dst
    contiguous); returns dst."""
    nbytes = dst.numel() * dst.element_size()
    if offset < 0 or offset + nbytes > src.numel() * src.element_size():
        raise ValueError(f"copy of {nbytes} B at {offset} outside a {src.nbytes} B tensor")
    d2d(dst.data_ptr(), src.data_ptr() + offset, nbytes, stream)
    return dst


@dataclass
class ArenaResults:
    """Bytes [off, off + 8n + w) of `arena`: token errors [2, n] fp32 (`reference.token_errors`),
    then the moved flags of the step's w target pages (bool)."""
    arena: torch.Tensor  # uint8, on the device
    off: int
    n: int
    w: int

    @property
    def end(self) -> int:
        return self.off + 8 * self.n + self.w

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token errors [2, n], moved flags [w]) as views of the arena."""
        a, o, n = self.arena, self.off, self.n
        return (a[o: o + 8 * n].view(torch.float32).view(2, n),
                a[o + 8 * n: self.end].view(torch.bool))

    def host(self, buf: np.ndarray, at: int) -> tuple[np.ndarray, np.ndarray]:
        """(token errors [2, n] float32, moved flags [w] bool) from `buf`, the arena's bytes
        from `at` on, copied home."""
        o, n = self.off - at, self.n
        return (buf[o: o + 8 * n].view(np.float32).reshape(2, n),
                buf[o + 8 * n: o + 8 * n + self.w].view(np.bool_))


class Arena:
    """The device bytes the graph steps' results are copied into, step after step, each 8-byte
    aligned. A full or sealed arena is left to the read-backs that hold its steps (`ArenaResults`):
    the caching allocator reuses it once they are gone, in stream order."""

    def __init__(self, steps: int):
        self.steps = steps  # a new arena's room, in steps of the size that asked for it
        self.mem: torch.Tensor | None = None
        self.used = 0

    def put(self, out: torch.Tensor, nbytes: int, n: int, w: int,
            stream: torch.cuda.Stream) -> ArenaResults:
        """out's first nbytes (token errors [2, n] fp32, moved flags [w]) copied in."""
        if self.mem is None or self.used + nbytes > self.mem.numel():
            self.mem = torch.empty(self.steps * (nbytes + 8), dtype=torch.uint8,
                                   device=out.device)
            self.used = 0
        off = self.used
        d2d(self.mem.data_ptr() + off, out.data_ptr(), nbytes, stream)
        self.used = off + nbytes + (-nbytes % 8)
        return ArenaResults(self.mem, off, n, w)

    def seal(self) -> None:
        self.mem = None


# a graph step's results are copied into the loop's arena (`ArenaResults`: one copy a step, no
# tensor made for them; a read-back copies the arena's span home at once)
ARENA_STEPS = 24  # steps' results an arena holds (a read-back takes `loop.EARLY`)


@dataclass
class _Entry:
    """One graph: static input buffers (int64 and int32 twins), the FA2 wrapper planned over
    views of them, the captured graph and its output buffer (token errors, moved targets)."""
    g64: torch.Tensor
    g32: torch.Tensor
    views: dict[str, torch.Tensor]
    wrapper: Any
    plan: graph_block.Layout
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None


class StepGraphs:
    """The graphs of one replay (its pool, truth store and watch are captured by address)."""

    def __init__(self, kernels: Any, pool: Any, truth: Any, hq: int, watch: Any):
        self.k, self.pool, self.truth, self.hq, self.watch = kernels, pool, truth, hq, watch
        self.checks = isinstance(watch, IncrementalWatch)  # events and checks in the graph
        m = pool.data
        self.planner = graph_block.Planner(graph_block.Device.of(m.device), hq, int(m.shape[3]),
                                       int(m.shape[4]), pool.page_size, m.element_size())
        self.entries: dict[Key, _Entry] = {}
        self.mismatched: set[Key] = set()  # keys whose first plan differed from FlashInfer's
        self.pool_handle = torch.cuda.graph_pool_handle()
        # the replay's stream, once: Event.record() without one builds it every call (~10 µs
        # of a step's host on the H200)
        self.stream = torch.cuda.current_stream()
        self.replays = self.captures = self.fallbacks = 0
        self.arena = Arena(ARENA_STEPS)  # where graph steps' results go

    def stats(self) -> dict[str, int]:
        return {"graphs": len(self.entries), "graph_replays": self.replays,
                "graph_captures": self.captures, "eager_fallbacks": self.fallbacks,
                "plan_mismatches": len(self.mismatched)}

    def run(self, p: Any) -> ArenaResults | tuple[torch.Tensor, torch.Tensor | None] | None:
        """Run step p: its results, or None: run it eagerly, events and all (its plan does not
        fit its graph). The results: per-token errors [2, nnz_q] fp32 as
        `reference.token_errors`, then its targets' moved flags [len(p.wpages)] bool with the
        incremental watch, in the loop's arena (with the incremental watch) or as (errors,
        None)."""
        key: Key = p.graph
        if key in self.mismatched:
            self.fallbacks += 1
            return None
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = self._entry(key)
        buf, off, words = p.dv.span("gblk")  # the step's block in its chunk's device copy
        if words > e.g64.numel():
            raise ValueError(f"step {p.b.step}: a block of {words} words for a graph of "
                             f"{e.g64.numel()}")
        # the int32 twin is made in the graph (`_body`); by address: `graphs`'s why
        d2d(e.g64.data_ptr(), buf.data_ptr() + 8 * off, 8 * words, self.stream)
        self.k._hold_plan_cache(p.b.plan_cache_size)
        if e.graph is None:
            if not self._first(e, p, key):
                del self.entries[key]  # FlashInfer's checks refused the step: eager reports it
                self.fallbacks += 1
                return None
            self.captures += 1
        else:
            e.graph.replay()  # its plan is in the block: `_body`'s conversion writes it
            self.replays += 1
        assert e.out is not None
        # the step's own copy: the next replay rewrites e.out. Measured no better on the H200:
        # a pinned host copy a step, which the read-back need not gather (52-58 µs a step with
        # the views against 28-40); the graph copying its results into a ring slot
        # itself (three more kernels a step: 0.01-0.02 ms slower a step). One copy
        # of both results, viewed apart: a copy and an allocation cost the loop 13-35 µs a
        # step on the H200's host
        n = p.b.num_tokens  # the layout of `_out`
        w = len(p.wpages) if self.checks else 0
        if self.checks:
            return self.arena.put(e.out, 8 * n + w, n, w, self.stream)
        both = into(torch.empty(8 * n + w, dtype=torch.uint8, device=e.out.device),
                            e.out, 0, self.stream)
        tok = both[: 8 * n].view(torch.float32).view(2, n)
        return tok, both[8 * n:].view(torch.bool) if self.checks else None

    def seal(self) -> None:
        """The steps after a read-back go to a new arena (`verdicts.send` copies one arena's
        span of steps home at once)."""
        self.arena.seal()

    def _entry(self, key: Key) -> _Entry:
        at = offsets(key)
        size = sum(at["kv_indices"])
        dev = self.pool.data.device
        g64 = torch.zeros(size, dtype=torch.int64, device=dev)
        g32 = torch.zeros(size, dtype=torch.int32, device=dev)
        v = {}
        for (name, _, kind), (o, m) in zip(_FIELDS, at.values(), strict=True):
            src = g64.view(torch.float64) if kind == "f" else g64 if kind == "i" else g32
            v[name] = src[o: o + m]
        v["limit"] = v["limit"].view(key[0], key[1])
        w = self.k.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.k.ws[1], "NHD", use_cuda_graph=True, qo_indptr_buf=v["qo"],
            paged_kv_indptr_buf=v["kv_indptr"], paged_kv_indices_buf=v["kv_indices"],
            paged_kv_last_page_len_buf=v["last_page_len"], backend="fa2")
        # FA2's plan is read from the block (`graph_block`): no copy of it in the graph, the
        # block's conversion writes it
        w.reset_workspace_buffer(self.k.ws[1], v["plan"].view(torch.uint8))
        return _Entry(g64, g32, v, w, graph_block.layout(self.planner, key[0], key[1]))

    def ahead(self, p: Any) -> None:
        """Capture the graph of step p's key now, if it has none, without running anything: the
        driver calls this once the step before p is queued, so the host captures while the
        device still works (after the prompts' prefill, its whole step), and p replays the
        graph as any later step does. If FlashInfer's plan() or the capture refuses, nothing is
        kept: p takes the `_first` way (plan, eager, capture) or runs eagerly."""
        key = p.graph
        if key is None or key in self.entries:
            return
        e = self._entry(key)
        if not self._plan_first(e, p, key):
            return
        try:
            e.graph = self._capture(e, key)
        except RuntimeError:
            return
        self.entries[key] = e
        self.captures += 1

    def _first(self, e: _Entry, p: Any, key: Key) -> bool:
        """A key's first step when `loop` did not capture it: planned, run eagerly over the
        static buffers (this step's result, and the warm-up of every kernel the capture then
        records), then captured for the steps after it. False if plan() refused the step
        (nothing ran: the eager step reports it)."""
        if not self._plan_first(e, p, key):
            return False
        self._body(e, key)
        e.graph = self._capture(e, key)
        return True

    def _plan_first(self, e: _Entry, p: Any, key: Key) -> bool:
        """Plan step p through FlashInfer's Python plan() (its checks, once per key) and check
        `graph_block`'s port against it: the plan info, and the bytes FlashInfer's planner left in
        its pinned buffer for the device. False if plan() refused the step or the port differs
        (the key is then kept out: its steps run eagerly)."""
        b, dv, m = p.b, p.dv, self.pool.data
        hkv, d = int(m.shape[3]), int(m.shape[4])
        w = e.wrapper
        try:
            w.plan(dv.view("run0_qo", HOST32), dv.kv_indptr_host, e.views["kv_indices"],
                   dv.last_page_len_host, self.hq, hkv, d, b.page_size, causal=True,
                   q_data_type=m.dtype, kv_data_type=m.dtype, seq_lens=dv.seq_lens_host,
                   uniform_q_len=key[1])
        except (ValueError, RuntimeError):
            return False
        # the planner wrote its pinned buffer before returning (the device's copy of it is async)
        theirs = w._pin_memory_int_workspace_buffer.numpy()[: e.plan.nbytes]
        if not graph_block.agrees(e.plan, list(w._plan_info), theirs, b.kv_indptr):
            self.mismatched.add(key)
            return False
        e.out = self._out(key, b.num_tokens)
        return True

    def _out(self, key: Key, n: int) -> torch.Tensor:
        """The graph's results as bytes: token errors [2, n] fp32, then moved flags [cap_w]."""
        return torch.empty(8 * n + key[4], dtype=torch.uint8, device=self.pool.data.device)

    def _capture(self, e: _Entry, key: Key) -> torch.cuda.CUDAGraph:
        """The body captured on a side stream (nothing runs: the step's work was done eagerly).
        Not `torch.cuda.graph`, whose device sync, gc.collect() and empty_cache() took a key's
        first step from 1.9 to 12.5 ms on the H200: nothing here needs them (the side stream
        waits for the current one; the graph's memory comes from the replay's own pool)."""
        g = torch.cuda.CUDAGraph()
        side, cur = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            g.capture_begin(pool=self.pool_handle, capture_error_mode="thread_local")
            try:
                self._body(e, key)
            finally:
                g.capture_end()
        cur.wait_stream(side)
        return g

    def _body(self, e: _Entry, key: Key) -> None:
        """The step's device work over the static buffers, results into e.out: what the driver
        does for an eager step (`loop._apply_events`, the watch, `loop._one_step`)."""
        from gpu_backend.device import pool_triton, reference_triton
        R, W = key[0], key[1]
        pool, m, tr, v, wt = self.pool, self.pool.data, self.truth.kv, e.views, self.watch
        hkv, d = int(m.shape[3]), int(m.shape[4])
        assert e.out is not None
        n = R * W
        # the int32 fields from the step's int64 words, on the device: one host copy a step
        # instead of two (~13 µs of host on the H200); the float64 fields' bits wrap, unread.
        # The plan's field is the wrapper's int workspace (`_entry`): this writes the plan too
        e.g32.copy_(e.g64)
        if self.checks:
            pool_triton.graph_events(pool.words, pool.rows, v["params"], v["touched"], v["prows"],
                               wt.sums, wt.stamp, wt.flag)
            pool_triton.graph_pre(pool.words, v["params"], v["touched"], v["wpages"], wt.sums,
                                  wt.pre,
                            wt.stamp, wt.flag)
        kv, q = content_kv_q(v["app_tok_m"], v["app_pos_m"], hkv, self.hq, d, m.dtype,
                             truth=(tr, v["tslot"], v["true_pos"]))
        assert q is not None
        side = self.truth.side  # the reference a branch of the graph beside the kernels
        with beside(side):
            ref = reference_triton.attend(q.view(R, W, self.hq, d), tr, v["slots"], v["limit"],
                                 int(tr.shape[3]))
        self.k.fi.append_paged_kv_cache(kv[0], kv[1], v["app_row"], v["append_pos"], m,
                                        v["kv_indices"], v["kv_indptr"], v["last_page_len"],
                                        kv_layout="NHD")
        out = unwritten(q)
        e.wrapper.run(q, m, out=out)
        if self.checks:
            pool_triton.graph_post(pool.words, v["params"], v["wpages"], wt.sums, wt.pre,
                             e.out[8 * n:].view(torch.int8))
        join(side)
        reference_triton.token_errors(out, ref.view(n, self.hq, d),
                             into=e.out[: 8 * n].view(torch.float32).view(2, n))
