"""`--backend flashinfer`: the engine's metadata through FlashInfer 0.7.2's real kernels.

Per step (re-planned every step, eager mode: see /work/shared/reference/flashinfer.md §5 on
stale CUDA-graph plans):
  append  `append_paged_kv_cache` at the engine's positions through the engine's flat table
          (no bounds checks, reference §3: a position past a row writes the next row's pages);
  attend  the batch split into maximal runs of one kind, each launched with the *global*
          `kv_indices` and its slice of `kv_indptr` (FA2's only clamp is the launch's last indptr):
          q_len 1 gen rows -> BatchDecodeWithPagedKVCacheWrapper (CUDA-core decode);
          verify / ctx rows -> BatchPrefillWithPagedKVCacheWrapper(backend fa2|fa3), causal;
          xqa steps' gen rows -> xqa_batch_decode_with_kv_cache(block_tables, seq_lens, mask)
          where XQA builds (page size 16/32/64/128, one draft width per launch, reference §4);
          otherwise, and for the ctx rows of xqa steps, FA2 over the block table's rows as CSR
          (layout.xqa_*: the pages XQA reads, lengths from seq_lens).
An fa2/fa3 step whose trace says the plan was built for another width/batch (`plan_q_len`,
`plan_batch`) is planned for that shape and run with the real query (reference §2: plans are
shape-specific). XQA has no plan, so there the mismatch has no kernel effect.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gpu_backend.driver import KernelFault
from gpu_backend.layout import StepBatch, launch_runs
from gpu_backend.pool import KVPool
from sim.trace.records import RowRecord

_WS = 256 << 20
_SPIN = 1_000_000  # GPU clock cycles (~0.5 ms) queued before a timed launch: hides host overhead


class FlashInferKernels:
    name = "flashinfer"

    def __init__(self, num_q_heads: int, device: torch.device | str, timing: bool = False,
                 attn_timing: bool = False):
        import flashinfer

        self.fi, self.num_q_heads, self.dev = flashinfer, num_q_heads, torch.device(device)
        ws = [torch.zeros(_WS, dtype=torch.uint8, device=self.dev) for _ in range(4)]
        self.ws = ws
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws[0], "NHD")
        self.prefill: dict[str, Any] = {}
        self.timing = timing
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # attn_timing: CUDA events around each attention launch only (gpu_backend.fidelity)
        self.attn_timing = attn_timing
        self.attn_events: list[tuple[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]]] = []

    def _prefill(self, backend: str) -> Any:
        if backend not in self.prefill:
            self.prefill[backend] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.ws[1], "NHD", backend=backend)
        return self.prefill[backend]

    def run_step(self, pool: KVPool, b: StepBatch, rows: list[RowRecord],
                 dv: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor) -> torch.Tensor:
        if self.timing:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        if self.attn_timing:
            self.attn_events.append((b.step, []))
        i32 = torch.int32
        indices = dv["kv_indices"].to(i32)
        try:
            self.fi.append_paged_kv_cache(
                k, v, dv["app_row"].to(i32), dv["append_pos"].to(i32), pool.data,
                indices, dv["kv_indptr"].to(i32), dv["last_page_len"].to(i32), kv_layout="NHD")
            out = torch.empty_like(q)
            for i, (s, e, kind) in enumerate(launch_runs(b)):
                out[b.qo_indptr[s]: b.qo_indptr[e]] = self._attend(pool, b, dv, i, s, e, kind, q,
                                                                    indices)
        except (ValueError, RuntimeError, AssertionError, NotImplementedError,
                AttributeError) as exc:
            if "CUDA" in str(exc) or "cuda" in str(exc):
                raise  # a device fault poisons the context: only --isolate survives it
            raise KernelFault(f"{type(exc).__name__}: {exc}") from None
        if self.timing:
            ev[1].record()
            self.events.append(ev)
        return out

    def kernel_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(z) for a, z in self.events]

    def attention_ms(self) -> dict[int, float]:
        """attn_timing: step -> summed time of its attention launches (append not included)."""
        torch.cuda.synchronize()
        return {k: sum(a.elapsed_time(z) for a, z in evs) for k, evs in self.attn_events}

    def _timed(self, launch: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One attention launch; with attn_timing between CUDA events, after a GPU spin so the
        start event fires once the host has queued the kernel (host overhead is not timed)."""
        if not self.attn_timing:
            return launch()
        torch.cuda._sleep(_SPIN)
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = launch()
        z.record()
        self.attn_events[-1][1].append((a, z))
        return out

    def _attend(self, pool: KVPool, b: StepBatch, dv: dict[str, torch.Tensor], i: int, s: int,
                e: int, kind: str, q: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        qr = q[b.qo_indptr[s]: b.qo_indptr[e]]
        if b.backend == "xqa":
            if kind != "ctx" and b.page_size in (16, 32, 64, 128) and np.all(
                    b.q_len[s:e] == b.q_len[s]):
                return self._xqa(pool, b, dv, s, e, qr)
            # ctx rows of a block-table engine, or shapes XQA does not build: FA2 over the
            # table rows, with the lengths the engine passed (what XQA would read)
            return self._csr(pool, b, dv, i, s, e, kind, qr, dv["xqa_indices"].to(torch.int32),
                             dv["xqa_indptr@host"][s: e + 1],
                             dv["xqa_last_page_len@host"][s:e])
        if b.plan_q_len >= 0 and kind != "ctx" and (b.plan_q_len, b.plan_batch) != (
                int(b.q_len[s]), e - s):
            return self._stale_plan(pool, b, s, e, qr, indices)
        # pinned host tensors: plan() reads them on the host and copies them asynchronously
        return self._csr(pool, b, dv, i, s, e, kind, qr, indices, dv["kv_indptr@host"][s: e + 1],
                         dv["last_page_len@host"][s:e])

    def _csr(self, pool: KVPool, b: StepBatch, dv: dict[str, torch.Tensor], i: int, s: int,
             e: int, kind: str, qr: torch.Tensor, indices: torch.Tensor, kv_indptr: torch.Tensor,
             lpl: torch.Tensor) -> torch.Tensor:
        hq, hkv, d, B = self.num_q_heads, pool.data.shape[3], pool.data.shape[4], b.page_size
        dt = pool.data.dtype
        if kind == "decode" and b.backend != "fa3":
            self.decode.plan(kv_indptr, indices, lpl, hq, hkv, d, B, q_data_type=dt,
                             kv_data_type=dt)
            return self._timed(lambda: self.decode.run(qr, pool.data))
        w = self._prefill("fa3" if b.backend == "fa3" else "fa2")
        qo = dv[f"run{i}_qo@host"]
        w.plan(qo, kv_indptr, indices, lpl, hq, hkv, d, B, causal=True, q_data_type=dt,
               kv_data_type=dt)
        return self._timed(lambda: w.run(qr, pool.data))

    def _stale_plan(self, pool: KVPool, b: StepBatch, s: int, e: int, qr: torch.Tensor,
                    indices: torch.Tensor) -> torch.Tensor:
        """Plan for (plan_batch, plan_q_len) over the step's own metadata (first rows, the last
        repeated if the plan was for more), then run the real query through it."""
        n = max(b.plan_batch, 1)
        sel = np.minimum(np.arange(n), e - s - 1) + s
        ptr = np.concatenate([b.kv_indptr[sel], [b.kv_indptr[min(s + n, e)]]])
        ptr = np.maximum.accumulate(ptr).astype(np.int32)
        hq, hkv, d, B = self.num_q_heads, pool.data.shape[3], pool.data.shape[4], b.page_size
        dt = pool.data.dtype
        w = self.fi.BatchDecodeWithPagedKVCacheWrapper(self.ws[2], "NHD",
                                                       use_tensor_cores=b.plan_q_len > 1)
        extra = {"q_len_per_req": b.plan_q_len} if b.plan_q_len > 1 else {}
        w.plan(torch.as_tensor(ptr), indices, torch.as_tensor(b.last_page_len[sel]), hq, hkv, d,
               B, q_data_type=dt, kv_data_type=dt, **extra)
        return self._timed(lambda: w.run(qr, pool.data)).reshape(qr.shape)

    def _xqa(self, pool: KVPool, b: StepBatch, dv: dict[str, torch.Tensor], s: int, e: int,
             qr: torch.Tensor) -> torch.Tensor:
        W = int(b.q_len[s])
        if np.any(b.q_len[s:e] != W):
            raise KernelFault("xqa: ragged draft widths in one launch are not replayed")
        d = pool.data.shape[4]
        bt = dv["block_table"][s:e].to(torch.int32)
        seq = dv["kv_len"][s:e].to(torch.int32)
        mask = None
        if W > 1:  # draft-block causal mask: bit j of row i set iff j <= i (reference §4)
            words = (W + 31) // 32
            bits = np.zeros((e - s, W, words), dtype=np.uint32)
            for i in range(W):
                for j in range(i + 1):
                    bits[:, i, j // 32] |= np.uint32(1 << (j % 32))
            mask = torch.as_tensor(bits.view(np.uint16), device=self.dev)
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        return self._timed(lambda: xqa_batch_decode_with_kv_cache(
            qr, pool.data, self.ws[3], bt, seq, bt.shape[1] * b.page_size,
            bmm1_scale=1.0 / math.sqrt(d), bmm2_scale=1.0, kv_layout="NHD",
            q_len_per_req=W, mask=mask)).reshape(qr.shape)
