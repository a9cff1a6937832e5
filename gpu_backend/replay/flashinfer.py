"""`--backend flashinfer`: the engine's metadata through FlashInfer 0.7.2's real kernels.

Per step (re-planned every step, eager mode: a plan is shape-specific, docs/design.md §3.5):
  append  `append_paged_kv_cache` at the engine's positions through the engine's flat table
          (no bounds checks: a position past a row writes the next row's pages);
  attend  the batch split into maximal runs of one kind, each launched with the *global*
          `kv_indices` and its slice of `kv_indptr` (FA2's only clamp is the launch's last indptr):
          q_len 1 gen rows -> BatchDecodeWithPagedKVCacheWrapper (CUDA-core decode);
          verify / ctx rows -> BatchPrefillWithPagedKVCacheWrapper(backend fa2|fa3), causal;
          xqa steps' gen rows -> xqa_batch_decode_with_kv_cache(block_tables, seq_lens, mask)
          where XQA builds (page size 16/32/64/128, one draft width per launch);
          otherwise, and for the ctx rows of xqa steps, FA2 over the block table's rows as CSR
          (layout.xqa_*: the pages XQA reads, lengths from seq_lens).
An fa2/fa3 step whose trace says the plan was built for another width/batch (`plan_q_len`,
`plan_batch`, `batch.stale_plan`) is planned for that shape and run with the real query
(plans are shape-specific); FlashInfer 0.7.2's run() refuses a query whose width
differs from the plan's (flashinfer/decode.py, BatchDecodeWithPagedKVCacheWrapper.run) and the
step is a `fault`. XQA has no plan, so there the mismatch has no kernel effect.

Every launch writes into one output buffer filled with NaN first (`out=`): a row no kernel writes
reads as NaN, never as whatever the allocator held.

No host-device syncs: the planners get pinned host arrays (indptr, last_page_len and the
`seq_lens` FlashInfer would otherwise compute into pageable memory and copy with a stream sync,
prefill.py plan()), and the decode planner's cached query range buffer is pinned too
(`_pin_range`). A planner writes its schedule into the wrapper's one pinned buffer and queues an
async copy from it (scheduler.cuh, no sync), so before re-planning a wrapper the host waits for
the event recorded after its last plan (`_plan`): the host runs at most a plan ahead of the
device instead of overwriting a schedule not yet copied.

The engine's plan cache (`plan_cache_size`) is held as TRT-LLM holds it, one decode and one
prefill wrapper per entry (each allocates its own 8 MiB int workspace on the device and 8 MiB of
pinned host memory, flashinfer/decode.py and prefill.py __init__); `stats()` reports the memory
measured for it. Eager TRT-LLM re-plans every cached wrapper in prepare(), so the entries add
memory, not stale plans.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gpu_backend.device.graphs import StepGraphs
from gpu_backend.device.pool import KernelFault, KVPool
from gpu_backend.device.reference import unwritten
from gpu_backend.host.batch import StepBatch, launch_runs, stale_plan
from gpu_backend.host.staging import HOST32, StepArrays
from sim.trace.records import RowRecord

_WS = 256 << 20
_SPIN = 1_000_000  # GPU clock cycles (~0.5 ms) queued before a timed launch: hides host overhead
Events = list[tuple[torch.cuda.Event, torch.cuda.Event]]


class FlashInferKernels:
    name = "flashinfer"

    def __init__(self, num_q_heads: int, device: torch.device | str, timing: bool = False,
                 attn_timing: bool = False, graphs: bool = True):
        import flashinfer

        self.fi, self.num_q_heads, self.dev = flashinfer, num_q_heads, torch.device(device)
        # FA2's and the decode's float workspaces hold scratch each launch writes before it
        # reads (FlashInfer's own examples allocate them with torch.empty, flashinfer/prefill.py):
        # zeroing them cost every replay a 768 MiB memset before its first launch. XQA's
        # (`xqa_ws`) and the decode wrapper (`decode`) are made on first use: a trace of prompts
        # and verify rows (the benchmark's) uses neither, and every replay made them, a 256 MiB
        # memset with them, before its first launch
        self.ws = [torch.empty(_WS, dtype=torch.uint8, device=self.dev) for _ in range(3)]
        self.prefill: dict[str, Any] = {}
        # timing: CUDA events around each launch (append and attention), each after a GPU spin
        # so the start event fires once the host has queued the launch: the kernels' own device
        # time, no host gaps (bench/gpu_replay.py times the wall in another pass, untimed)
        self.timing = timing
        self.events: list[Events] = []
        # attn_timing: the same, attention launches only (gpu_backend.tools.fidelity)
        self.attn_timing = attn_timing
        self.attn_events: list[tuple[int, Events]] = []
        self.fence: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> event after its last plan
        self.wait_s = 0.0  # host seconds spent waiting on those events (device-bound time)
        self.masks: dict[tuple[int, int], torch.Tensor] = {}  # XQA spec masks by (rows, W)
        self.plan_cache: list[tuple[Any, Any]] = []
        self.plan_cache_device = 0
        self.plan_cache_pinned: int | None = 0
        # steady steps as CUDA graphs (`gpu_backend.device.graphs`); not with timing (events per
        # launch)
        self.graphs = graphs and not (timing or attn_timing)

    @functools.cached_property
    def decode(self) -> Any:
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(self.ws[0], "NHD")

    @functools.cached_property
    def xqa_ws(self) -> torch.Tensor:
        """XQA's workspace, zeroed: FlashInfer's XQA decode wants it zero on first use (its
        docstrings in flashinfer/decode.py)."""
        return torch.zeros(_WS, dtype=torch.uint8, device=self.dev)

    def _prefill(self, backend: str) -> Any:
        if backend not in self.prefill:
            self.prefill[backend] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.ws[1], "NHD", backend=backend)
        return self.prefill[backend]

    def run_step(self, pool: KVPool, b: StepBatch, rows: list[RowRecord],
                 dv: StepArrays, k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor) -> torch.Tensor:
        self._hold_plan_cache(b.plan_cache_size)
        out = unwritten(q)  # a row no launch writes reads as NaN
        if self.timing:
            self.events.append([])
        if self.attn_timing:
            self.attn_events.append((b.step, []))
        indices = dv.kv_indices_i32
        try:
            self._timed(lambda: self.fi.append_paged_kv_cache(
                k, v, dv.app_row_i32, dv.append_pos_i32, pool.data, indices,
                dv.kv_indptr_i32, dv.last_page_len_i32, kv_layout="NHD"), attention=False)
            for i, (s, e, kind) in enumerate(launch_runs(b)):
                o = out[b.qo_indptr[s]: b.qo_indptr[e]]
                got = self._attend(pool, b, dv, i, s, e, kind, q, indices, o)
                if got.data_ptr() != o.data_ptr():
                    o.copy_(got.reshape(o.shape))
        except (ValueError, RuntimeError, AssertionError, NotImplementedError,
                AttributeError) as exc:
            if "CUDA" in str(exc) or "cuda" in str(exc):
                raise  # a device fault poisons the context: only --isolate survives it
            raise KernelFault(f"{type(exc).__name__}: {exc}") from None
        return out

    def step_graphs(self, pool: KVPool, truth: Any, hq: int, watch: Any) -> Any:
        """The replay's `graphs.StepGraphs`, or None (eager: --eager, or timing each launch)."""
        if not self.graphs:
            return None
        return StepGraphs(self, pool, truth, hq, watch)

    def _hold_plan_cache(self, n: int) -> None:
        """Hold n plan-cache entries (decode + prefill wrapper each, as TRT-LLM's
        FlashInferWrappers) and measure the memory they take."""
        while len(self.plan_cache) < n:
            dev0, pin0 = torch.cuda.memory_allocated(self.dev), _pinned_bytes()
            self.plan_cache.append((
                self.fi.BatchDecodeWithPagedKVCacheWrapper(self.ws[0], "NHD"),
                self.fi.BatchPrefillWithPagedKVCacheWrapper(self.ws[1], "NHD", backend="fa2")))
            self.plan_cache_device += torch.cuda.memory_allocated(self.dev) - dev0
            pin1 = _pinned_bytes()
            self.plan_cache_pinned = (None if pin0 is None or pin1 is None
                                      or self.plan_cache_pinned is None
                                      else self.plan_cache_pinned + pin1 - pin0)

    def stats(self) -> dict[str, Any]:
        return {"plan_cache_entries": len(self.plan_cache),
                "plan_cache_device_bytes": self.plan_cache_device,
                "plan_cache_pinned_bytes": self.plan_cache_pinned}

    def kernel_ms(self) -> list[float]:
        """timing: per step, the summed device time of its launches (append + attention)."""
        torch.cuda.synchronize()
        return [sum(a.elapsed_time(z) for a, z in evs) for evs in self.events]

    def attention_ms(self) -> dict[int, float]:
        """attn_timing: step -> summed time of its attention launches (append not included)."""
        torch.cuda.synchronize()
        return {k: sum(a.elapsed_time(z) for a, z in evs) for k, evs in self.attn_events}

    def _timed(self, launch: Callable[[], Any], attention: bool = True) -> Any:
        """One launch; with timing (or attn_timing, attention only) between CUDA events, after a
        GPU spin so the start event fires once the host has queued the kernel (host overhead is
        not timed)."""
        lists = ([self.events[-1]] if self.timing else []) + \
            ([self.attn_events[-1][1]] if self.attn_timing and attention else [])
        if not lists:
            return launch()
        torch.cuda._sleep(_SPIN)
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = launch()
        z.record()
        for evs in lists:
            evs.append((a, z))
        return out

    def _plan(self, w: Any, *args: Any, **kw: Any) -> None:
        """w.plan(...) once the device has copied w's previous schedule out of w's pinned buffer
        (module docstring); in steady state that copy is long done."""
        ev = self.fence.get(id(w))
        if ev is not None:
            t0 = time.perf_counter()
            ev.synchronize()
            self.wait_s += time.perf_counter() - t0
        w.plan(*args, **kw)
        ev = torch.cuda.Event()
        ev.record()
        self.fence[id(w)] = ev

    def _attend(self, pool: KVPool, b: StepBatch, dv: StepArrays, i: int, s: int,
                e: int, kind: str, q: torch.Tensor, indices: torch.Tensor,
                o: torch.Tensor) -> torch.Tensor:
        qr = q[b.qo_indptr[s]: b.qo_indptr[e]]
        if b.backend == "xqa":
            if kind != "ctx" and b.page_size in (16, 32, 64, 128) and np.all(
                    b.q_len[s:e] == b.q_len[s]):
                return self._xqa(pool, b, dv, s, e, qr, o)
            # ctx rows of a block-table engine, or shapes XQA does not build: FA2 over the
            # table rows, with the lengths the engine passed (what XQA would read)
            return self._csr(pool, b, dv, i, s, e, kind, qr, dv.xqa_indices_i32,
                             dv.xqa_indptr_host[s: e + 1],
                             dv.xqa_last_page_len_host[s:e], dv.xqa_seq_lens_host[s:e], o)
        stale = stale_plan(b, s, e, kind)
        if stale is not None:
            return self._stale_plan(pool, b, s, e, qr, indices, *stale, o)
        # pinned host tensors: plan() reads them on the host and copies them asynchronously
        return self._csr(pool, b, dv, i, s, e, kind, qr, indices, dv.kv_indptr_host[s: e + 1],
                         dv.last_page_len_host[s:e], dv.seq_lens_host[s:e], o)

    def _csr(self, pool: KVPool, b: StepBatch, dv: StepArrays, i: int, s: int,
             e: int, kind: str, qr: torch.Tensor, indices: torch.Tensor, kv_indptr: torch.Tensor,
             lpl: torch.Tensor, seq: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """seq: the kv lengths FlashInfer's get_seq_lens would compute from kv_indptr and lpl,
        from pinned memory (layout.kernel_arrays)."""
        hq, hkv, d, B = self.num_q_heads, pool.data.shape[3], pool.data.shape[4], b.page_size
        dt = pool.data.dtype
        if kind == "decode" and b.backend != "fa3":
            _pin_range(e - s + 1)
            self._plan(self.decode, kv_indptr, indices, lpl, hq, hkv, d, B, q_data_type=dt,
                       kv_data_type=dt, seq_lens=seq)
            return self._timed(lambda: self.decode.run(qr, pool.data, out=o))
        w = self._prefill("fa3" if b.backend == "fa3" else "fa2")
        qo = dv.view(f"run{i}_qo", HOST32)
        self._plan(w, qo, kv_indptr, indices, lpl, hq, hkv, d, B, causal=True, q_data_type=dt,
                   kv_data_type=dt, seq_lens=seq)
        return self._timed(lambda: w.run(qr, pool.data, out=o))

    def _stale_plan(self, pool: KVPool, b: StepBatch, s: int, e: int, qr: torch.Tensor,
                    indices: torch.Tensor, n: int, width: int, o: torch.Tensor) -> torch.Tensor:
        """Plan a decode wrapper for batch n and query width `width` over the step's own metadata
        (the run's first rows, the last repeated if the plan was for more), then run the real
        query through it. A width > 1 needs the tensor-core (FA2) decode path.

        The output is a NaN buffer of its own, padded to the plan's n * width rows: rows the plan
        does not cover stay NaN, and a plan for more rows than the query (docs/design.md §3.5: the
        kernel then writes past `out`) writes into the padding, not into another launch's rows."""
        sel = np.minimum(np.arange(n), e - s - 1) + s
        ptr = np.concatenate([b.kv_indptr[sel], [b.kv_indptr[min(s + n, e)]]])
        ptr = np.maximum.accumulate(ptr).astype(np.int32)
        hq, hkv, d, B = self.num_q_heads, pool.data.shape[3], pool.data.shape[4], b.page_size
        dt = pool.data.dtype
        w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.ws[2], "NHD",
                                                       use_tensor_cores=width > 1)
        extra = {"q_len_per_req": width} if width > 1 else {}
        w.plan(torch.as_tensor(ptr), indices, torch.as_tensor(b.last_page_len[sel]), hq, hkv, d,
               B, q_data_type=dt, kv_data_type=dt, **extra)
        buf = torch.full((max(n * width, o.shape[0]), *o.shape[1:]), float("nan"),
                         dtype=o.dtype, device=o.device)
        got = self._timed(lambda: w.run(qr, pool.data, out=buf[: o.shape[0]]))
        # w (its pinned schedule buffer) dies with this call while its async copy may still be
        # queued: wait for it here (a rare path: hand-built stale-plan traces)
        torch.cuda.current_stream().synchronize()
        return got

    def _xqa(self, pool: KVPool, b: StepBatch, dv: StepArrays, s: int, e: int,
             qr: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        W = int(b.q_len[s])
        if np.any(b.q_len[s:e] != W):
            raise KernelFault("xqa: ragged draft widths in one launch are not replayed")
        d = pool.data.shape[4]
        bt = dv.block_table_i32[s:e]
        seq = dv.kv_len_i32[s:e]
        mask = self._xqa_mask(e - s, W) if W > 1 else None
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        # out: [B, W, H, D] for W > 1 (the query's view inside xqa_batch_decode_with_kv_cache)
        ox = o.view(e - s, W, *o.shape[1:]) if W > 1 else o
        ws = self.xqa_ws  # made (zeroed) before a timed launch's events, not between them
        return self._timed(lambda: xqa_batch_decode_with_kv_cache(
            qr, pool.data, ws, bt, seq, bt.shape[1] * b.page_size,
            bmm1_scale=1.0 / math.sqrt(d), bmm2_scale=1.0, kv_layout="NHD",
            q_len_per_req=W, mask=mask, out=ox))


    def _xqa_mask(self, n: int, W: int) -> torch.Tensor:
        """The draft-block causal mask, bit j of row i set iff j <= i; built and
        uploaded once per shape (an upload from pageable memory syncs the stream)."""
        if (n, W) not in self.masks:
            words = (W + 31) // 32
            bits = np.zeros((n, W, words), dtype=np.uint32)
            for i in range(W):
                for j in range(i + 1):
                    bits[:, i, j // 32] |= np.uint32(1 << (j % 32))
            self.masks[(n, W)] = torch.as_tensor(bits.view(np.uint16), device=self.dev)
        return self.masks[(n, W)]


def _pin_range(n: int) -> None:
    """Pin FlashInfer's cached host range buffer that the decode planner copies to the device as
    its qo_indptr (decode.py plan(): `_get_range_buf(batch + 1, "cpu").to(device)`): from
    pageable memory that copy is a stream sync per plan. FlashInfer 0.7.2 internals
    (utils._cache_buf, keyed by the power of two above n); a no-op if they move."""
    try:
        from flashinfer import utils
    except ImportError:
        return
    cache = getattr(utils, "_cache_buf", None)
    if not isinstance(cache, dict):
        return
    n2 = 1 << (n - 1).bit_length()
    key = (f"range_{n2}", "cpu")
    buf = cache.get(key)
    if buf is None or not buf.is_pinned():
        cache[key] = torch.arange(n2, dtype=torch.int32).pin_memory()


def _pinned_bytes() -> int | None:
    """Pinned host memory checked out of torch's host allocator (None where this torch does not
    say). Active bytes, not allocated: the allocator caches freed pinned blocks, so an earlier
    replay's freed wrappers would hide a new wrapper's allocation (first H200 run: 56 MiB
    "allocated" growth for 5 cache entries, 16 MiB for 1 in a fresh process, 0 after it)."""
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    v = stats.get("active_bytes.current")
    return None if v is None else int(v)
