"""A steady step's device work as one CUDA graph: content, append, attention, reference, errors.

Why: at batch 64 x kv 2k the step's kernels take ~0.15 ms of device time, and the host took
0.6-1.4 ms to queue them eagerly (docs/gpu.md rounds 3-9: ~13 launches, FlashInfer's Python
plan() and run(), and the Python between them): the replay was host-bound at 4-8x the kernels'
time. Here such a step costs the host two copies, FlashInfer's C++ planner and one graph launch.

Which steps: the steady state of a speculative-decoding trace, one FA2 launch over every row
with one query width W (verify rows), content and truth at the same positions, the reference one
batched group (`prepare.RefGroup.identity`), no prefix fills, no RoPE overrun, no stale plan.
`prepare` stages such a step's inputs one after the other (`block`), so the step's copy into the
static buffers is two copies (the chunk's int64 and int32 twins), whatever the fields.

What is the same as the eager step: every kernel (the content and reference Triton kernels,
FlashInfer's append and FA2 paged prefill), its inputs and its order; the FA2 kernel is planned
per step by FlashInfer's own planner in its CUDA-graph mode (scheduler.cuh `PrefillPlan`: a
fixed grid, always split over the kv, `uniform_q_len` tiles), the way SGLang and vLLM replay it.
The reference gets the truth store's span as its key bound instead of the step's longest row:
it stops at each row's own last limit either way (`refattn._attend_kernel`), so the bits match.
What differs: FA2's split-kv merge order (rounding within the tolerance), and FlashInfer's
Python checks in plan()/run(), which run once per shape at capture instead of every step.

Graphs are keyed by (rows, W, page-list capacity); a step whose plan comes back different from
its graph's (offsets in FlashInfer's workspace) runs eagerly (`stats()['eager_fallbacks']`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_backend.layout import StepBatch, launch_runs, stale_plan
from gpu_backend.staging import ALIGN, StepArrays

# pinned plan buffers a graph cycles through: the host re-plans into the one whose copy the
# device made RING steps ago, so it waits only when the device is RING steps behind (one buffer,
# as FlashInfer's wrapper has, made it wait ~100 µs a step at batch 64 x kv 2k on the H200)
RING = 4
# the block's fields in order: (field, the step's array staged for it, how the kernels read it:
# "f" float64, "i" int64, "w" int32); "g0_" is the reference's one group (`prepare.RefGroup`)
_FIELDS = (("app_tok_m", "app_tok_m", "f"), ("app_pos_m", "app_pos_m", "f"),
           ("tslot", "tslot", "i"), ("true_pos", "true_pos", "i"), ("app_row", "app_row", "w"),
           ("append_pos", "append_pos", "w"), ("qo", "run0_qo", "w"),
           ("kv_indptr", "kv_indptr", "w"), ("last_page_len", "last_page_len", "w"),
           ("slots", "g0_slots", "i"), ("limit", "g0_limit", "i"),
           ("kv_indices", "kv_indices", "w"))

Key = tuple[int, int, int]  # (rows, query width W, capacity of kv_indices)


def offsets(R: int, W: int, P: int) -> dict[str, tuple[int, int]]:
    """Field -> (offset, length) in words of a block for R rows of width W and P pages: the
    fields one after the other, each aligned as `staging.Chunk.add` aligns an array."""
    sizes = {"qo": R + 1, "kv_indptr": R + 1, "last_page_len": R, "slots": R, "limit": R * W,
             "kv_indices": P}
    out, at = {}, 0
    for name, _, _ in _FIELDS:
        n = sizes.get(name, R * W)
        out[name] = (at, n)
        at += n + (-n % ALIGN)
    return out


def block(b: StepBatch, arrays: dict[str, np.ndarray], fill: bool, eng_nan: bool,
          direct: bool, groups: list[Any]) -> Key | None:
    """If step b can replay as a graph, order its arrays so that the graph's fields are staged
    first, one after the other (the block `span` names), and return its graph key; else None.
    `direct`: truth positions == engine's and the queries are the appends; `groups`: the
    reference's (`prepare.RefGroup`)."""
    R = b.num_rows
    runs = launch_runs(b)
    if (b.backend != "fa2" or fill or eng_nan or not direct or len(groups) != 1
            or not groups[0].identity or groups[0].pre != "g0_" or len(runs) != 1
            or runs[0][2] != "verify" or stale_plan(b, 0, R, "verify") is not None):
        return None
    first = {name: arrays.pop(name) for _, name, _ in _FIELDS}
    rest = dict(arrays)
    arrays.clear()
    arrays |= first | rest
    P = len(b.kv_indices)
    return R, int(b.q_len[0]), 1 << max(P - 1, 0).bit_length()


def span(dv: StepArrays) -> None:
    """Name the staged block `gblk` (int64 words; `gblk@32` its int32 twin): from the first
    field to the end of the last."""
    (_, _, first), (shape, _, last) = dv.slots["app_tok_m"], dv.slots["kv_indices"]
    dv.slots["gblk"] = ((last + shape[0] - first,), (1,), first)


@dataclass
class _Entry:
    """One graph: static input buffers (int64 and int32 twins), the FA2 wrapper planned over
    views of them, the captured graph and its output."""
    g64: torch.Tensor
    g32: torch.Tensor
    views: dict[str, torch.Tensor]
    wrapper: Any
    graph: torch.cuda.CUDAGraph | None = None
    tok: torch.Tensor | None = None
    plan_info: Any = None
    plan_args: list[Any] | None = None
    # the planner's pinned buffers, one per step in turn (slot 0: the wrapper's own), and the
    # event after each one's last plan: its async copy to the device is done once that fires
    pins: list[torch.Tensor] = field(default_factory=list)
    fences: list[torch.cuda.Event] = field(default_factory=list)
    plans: int = 0


class StepGraphs:
    """The graphs of one replay (its pool and truth store are captured by address)."""

    def __init__(self, kernels: Any, pool: Any, truth: Any, hq: int):
        self.k, self.pool, self.truth, self.hq = kernels, pool, truth, hq
        self.entries: dict[Key, _Entry] = {}
        self.pool_handle = torch.cuda.graph_pool_handle()
        self.replays = self.captures = self.fallbacks = 0

    def stats(self) -> dict[str, int]:
        return {"graphs": len(self.entries), "graph_replays": self.replays,
                "graph_captures": self.captures, "eager_fallbacks": self.fallbacks}

    def run(self, p: Any) -> torch.Tensor | None:
        """The step's per-token errors ([2, nnz_q] fp32, as `oracle.token_errors`), or None when
        it must run eagerly (its plan does not fit its graph)."""
        key: Key = p.graph
        R, W, cap = key
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = self._entry(R, W, cap)
        blk64, blk32 = p.dv["gblk"], p.dv["gblk@32"]
        n = int(blk64.shape[0])
        e.g64[:n].copy_(blk64)
        e.g32[:n].copy_(blk32)
        self.k._hold_plan_cache(p.b.plan_cache_size)
        if e.graph is None:
            try:
                return self._first(e, p, R, W)
            except (ValueError, RuntimeError):
                del self.entries[key]  # FlashInfer's checks refused the step: eager reports it
                self.fallbacks += 1
                return None
        if not self._plan(e, p):
            self.fallbacks += 1
            return None
        e.graph.replay()
        self.replays += 1
        assert e.tok is not None
        return e.tok.clone()  # the step's own copy: the next replay rewrites e.tok

    def _entry(self, R: int, W: int, cap: int) -> _Entry:
        at = offsets(R, W, cap)
        size = sum(at["kv_indices"])
        dev = self.pool.data.device
        g64 = torch.zeros(size, dtype=torch.int64, device=dev)
        g32 = torch.zeros(size, dtype=torch.int32, device=dev)
        v = self._views(g64, g32, R, W, cap)
        w = self.k.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.k.ws[1], "NHD", use_cuda_graph=True, qo_indptr_buf=v["qo"],
            paged_kv_indptr_buf=v["kv_indptr"], paged_kv_indices_buf=v["kv_indices"],
            paged_kv_last_page_len_buf=v["last_page_len"], backend="fa2")
        return _Entry(g64, g32, v, w)

    @staticmethod
    def _views(g64: torch.Tensor, g32: torch.Tensor, R: int, W: int, cap: int
               ) -> dict[str, torch.Tensor]:
        out = {}
        for (name, _, kind), (o, m) in zip(_FIELDS, offsets(R, W, cap).values(), strict=True):
            src = g64.view(torch.float64) if kind == "f" else g64 if kind == "i" else g32
            out[name] = src[o: o + m]
        out["limit"] = out["limit"].view(R, W)
        return out

    def _first(self, e: _Entry, p: Any, R: int, W: int) -> torch.Tensor:
        """A key's first step: planned through FlashInfer's Python plan() (its checks, once),
        run eagerly over the static buffers (this step's result, and the warm-up every capture
        needs), then captured for the steps after it."""
        b, dv = p.b, p.dv
        m = self.pool.data
        hkv, d = int(m.shape[3]), int(m.shape[4])
        v = e.views
        w = e.wrapper
        e.pins = [w._pin_memory_int_workspace_buffer] + [
            torch.empty_like(w._pin_memory_int_workspace_buffer, pin_memory=True)
            for _ in range(RING - 1)]
        e.fences = [torch.cuda.Event() for _ in range(RING)]
        e.wrapper.plan(dv["run0_qo@host"], dv["kv_indptr@host"], v["kv_indices"],
                       dv["last_page_len@host"], self.hq, hkv, d, b.page_size, causal=True,
                       q_data_type=m.dtype, kv_data_type=m.dtype, seq_lens=dv["seq_lens@host"],
                       uniform_q_len=W)
        e.fences[0].record()
        e.plans = 1
        e.plan_info = _info(e.wrapper._plan_info)
        e.plan_args = self._plan_args(e, R, W, b.page_size, hkv, d)
        tok = self._body(e, R, W).clone()
        e.graph, e.tok = self._capture(e, R, W)
        self.captures += 1
        return tok

    def _capture(self, e: _Entry, R: int, W: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
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
                tok = self._body(e, R, W)
            finally:
                g.capture_end()
        cur.wait_stream(side)
        return g, tok

    def _body(self, e: _Entry, R: int, W: int) -> torch.Tensor:
        """The step's device work over the static buffers: what `driver._one_step` does for it."""
        from gpu_backend import refattn
        from gpu_backend.pool import content_kv_q

        m, tr, v = self.pool.data, self.truth.kv, e.views
        hkv, d = int(m.shape[3]), int(m.shape[4])
        kv, q = content_kv_q(v["app_tok_m"], v["app_pos_m"], hkv, self.hq, d, m.dtype,
                             truth=(tr, v["tslot"], v["true_pos"]))
        assert q is not None
        self.k.fi.append_paged_kv_cache(kv[0], kv[1], v["app_row"], v["append_pos"], m,
                                        v["kv_indices"], v["kv_indptr"], v["last_page_len"],
                                        kv_layout="NHD")
        out = torch.full_like(q, float("nan"))
        e.wrapper.run(q, m, out=out)
        ref = refattn.attend(q.view(R, W, self.hq, d), tr, v["slots"], v["limit"],
                             int(tr.shape[3]))
        return refattn.token_errors(out, ref.view(R * W, self.hq, d))

    def _plan_args(self, e: _Entry, R: int, W: int, page: int, hkv: int, d: int) -> list[Any]:
        """FlashInfer 0.7.2's FA2 planner arguments as its plan() builds them (prefill.py), the
        three host arrays left as None (each step's own, `_plan`)."""
        w = e.wrapper
        return [w._float_workspace_buffer, w._int_workspace_buffer,
                w._pin_memory_int_workspace_buffer, None, None, None, w._max_total_num_rows,
                R, self.hq, hkv, page, True, d, d, True, -1, -1, False, 0, W]

    def _plan(self, e: _Entry, p: Any) -> bool:
        """FlashInfer's C++ planner for this step (its Python checks passed at capture: same
        shapes), into the next pinned buffer of the ring; True if its plan fits the graph."""
        assert e.plan_args is not None
        args = list(e.plan_args)
        dv = p.dv
        slot = e.plans % RING
        e.plans += 1
        args[2:6] = e.pins[slot], dv["run0_qo@host"], dv["kv_indptr@host"], dv["seq_lens@host"]
        ev = e.fences[slot]
        t0 = time.perf_counter()
        ev.synchronize()  # the device has copied this buffer's last plan out
        self.k.wait_s += time.perf_counter() - t0
        try:
            info = e.wrapper._cached_module.plan(*args)
        except RuntimeError:
            return False  # FlashInfer refuses the metadata: the eager step reports it
        finally:
            ev.record()
        return _info(info) == e.plan_info


def _info(x: Any) -> list[int]:
    """A plan's info (FlashInfer's int64 vector, a tvm-ffi array in 0.7.2) as a list."""
    return [int(v) for v in x]
