"""The replay loop shared by both backends: trace -> pool -> kernels -> verdicts per row.

Per step k:
  1. apply the block events between launch k-1 and launch k (alloc/evict poison, copies); then
     the worst legal device timing under overlap: step k runs only after the host events up to its
     `done` event, so the pages `free`d in that window by a request in step k (and pages freed
     twice while another request or the prefix cache holds them) are poisoned before k runs
     (`in_flight_poison`: the pages were handed out and refilled while k was in flight);
  2. build K/V/Q from (token, engine RoPE position), truth K/V and Q from (token, true position);
     the engine's K/Q at a position past its RoPE table (max_position_embeddings) are NaN;
  3. kernels: append at the engine's positions through the engine's table, then attention with
     the engine's metadata (backend-specific: FlashInfer on the GPU, access model on the CPU);
  4. checksum pages, fp32 reference over the truth, verdicts (kept on the device);
  5. poison the slots of rejected drafts (the rewind).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from gpu_backend.layout import StepBatch, build_step, run_arrays
from gpu_backend.oracle import (
    DEFAULT_TOL,
    FAULT,
    VERDICTS,
    TruthStore,
    reference,
    reference_arrays,
    row_verdicts,
)
from gpu_backend.pool import KVPool, content, torch_dtype
from gpu_backend.staging import Staging
from gpu_backend.tracedata import TraceData
from sim.trace.records import RowRecord

GUARD_PAGES = 16


class KernelFault(Exception):
    """The kernels refused the step (a host-side check) or the backend saw an invalid access."""


class Kernels(Protocol):
    name: str

    def run_step(self, pool: KVPool, b: StepBatch, rows: list[RowRecord],
                 dv: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor) -> torch.Tensor:
        """Append k/v [nnz_q, H_kv, D] and return attention out [nnz_q, H_q, D] for q.
        dv: the step's index arrays on the device (see `device_arrays`)."""
        ...


@dataclass
class RowResult:
    step: int
    row: int
    request: int
    phase: str
    q_len: int
    verdict: str
    err: float
    message: str = ""


@dataclass
class ReplayResult:
    backend: str
    trace: str
    tol: float
    rows: list[RowResult] = field(default_factory=list)
    # what the kernels measured beside the rows (FlashInfer: the plan cache's memory)
    stats: dict[str, Any] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(VERDICTS, 0)
        for r in self.rows:
            out[r.verdict] += 1
        return out

    @property
    def ok(self) -> bool:
        return all(r.verdict == "ok" for r in self.rows)


def apply_events(pool: KVPool, trace: TraceData, step: int,
                 refcount: dict[int, int], poison: frozenset[int] = frozenset()) -> list[int]:
    """Events after launch step-1 and before launch step; returns the pool indices touched and
    keeps `refcount` (block -> holders, from the events) current.

    alloc/evict hand a block to a new owner: its old content is garbage to it, so it is poisoned.
    free keeps content (a cached block may be reused), except the frees whose `seq` is in
    `poison` (a double free of a live block: see `in_flight_poison`); copy moves the first
    num_tokens slots."""
    touched: list[int] = []
    for key in ((step - 1, "proc"), (step, "sched")):
        for ev in trace.events.get(key, ()):
            if ev.event == "done":
                continue
            refcount[ev.block] = ev.refcount
            i = pool.index(ev.block)
            if ev.event in ("alloc", "evict") or ev.seq in poison:
                pool.data[i] = float("nan")
            elif ev.event == "copy" and ev.src >= 0:
                pool.copy_slots(i, pool.index(ev.src), ev.num_tokens or pool.page_size)
            else:
                continue
            touched.append(i)
    return touched


@dataclass
class InFlight:
    """What `in_flight_poison` found: step -> engine block ids to poison before the step runs,
    and the seqs of double frees of live blocks outside any window (poisoned in order)."""
    before_step: dict[int, list[int]] = field(default_factory=dict)
    double_free: frozenset[int] = frozenset()


def in_flight_poison(trace: TraceData) -> InFlight:
    """The frees the device could see while a step is in flight (overlap, docs/trace.md).

    Step k is in flight from its launch until the host's `done` event with src == k. A `free`
    in that window of a block its request holds, by a request with a row in step k, hands the
    pages back while k may still read them: the allocator may refill them (TRT-LLM's
    TRTLLM_KV_FRESH_PAGE_FILL poisons pages as it hands them out), so the worst legal timing
    runs k after that refill. A `free` by a request that no longer holds the block (a double
    free) puts it in the free list while another request or the prefix cache still holds it: it
    is poisoned too (before the step whose window it falls in, else at its place in order).
    A trace without `done` events (hand-built) is replayed strictly in order: nothing here."""
    flat = sorted((e for evs in trace.events.values() for e in evs), key=lambda e: e.seq)
    if not any(e.event == "done" for e in flat):
        return InFlight()
    holders: dict[int, list[int]] = {}
    cached: set[int] = set()
    own_free: set[int] = set()  # seqs of frees by a holder
    live_double: set[int] = set()  # seqs of double frees of a block someone else keeps
    for e in flat:
        held = holders.setdefault(e.block, [])
        if e.event == "alloc":
            held[:] = [e.request]
            cached.discard(e.block)
        elif e.event == "reuse":
            held.append(e.request)
        elif e.event == "evict":
            held.clear()
            cached.discard(e.block)
        elif e.event == "hash":
            cached.add(e.block)
        elif e.event in ("free", "rewind"):
            if e.request in held:
                held.remove(e.request)
                if e.event == "free":
                    own_free.add(e.seq)
            elif e.event == "free" and (held or e.block in cached):
                live_double.add(e.seq)
    keys = [(e.step, 0 if e.phase == "sched" else 1) for e in flat]
    out = InFlight()
    windowed: set[int] = set()
    for s in trace.steps:
        reqs = {r.request for r in trace.rows[s.step]}
        if not reqs:
            continue
        blocks: list[int] = []
        for e in flat[bisect.bisect_left(keys, (s.step, 1)):]:
            if e.event == "done" and e.src == s.step:
                break
            if e.event != "free":
                continue
            if (e.seq in own_free and e.request in reqs) or e.seq in live_double:
                blocks.append(e.block)
                windowed.add(e.seq)
        if blocks:
            out.before_step[s.step] = blocks
    out.double_free = frozenset(live_double - windowed)
    return out


def replay(trace: TraceData, kernels: Kernels, device: torch.device | str, tol: float = DEFAULT_TOL,
           skip: dict[int, str] | None = None,
           on_step: Callable[[int, str], None] | None = None) -> ReplayResult:
    """Replay every step of `trace`. `skip` maps steps not to run to a fault message (--isolate);
    `on_step(step, "start"|"done")` is called around each step (the child's progress report)."""
    m = trace.model
    dt = torch_dtype(m.dtype)
    pool = KVPool(m.num_blocks, GUARD_PAGES, m.page_size, m.num_kv_heads, m.head_dim, dt, device)
    truth = TruthStore(trace.rows, trace.prompts, m.num_kv_heads, m.head_dim, dt, device)
    skip = skip or {}
    res = ReplayResult(kernels.name, str(trace.path), tol)
    codes: list[torch.Tensor] = []
    errs: list[torch.Tensor] = []
    msgs: dict[int, str] = {}
    stage = Staging(device)
    refcount: dict[int, int] = {}
    flight = in_flight_poison(trace)
    rope_rows = m.max_position
    before = pool.checksum()
    for s in trace.steps:
        rows = trace.rows[s.step]
        if not rows:
            continue
        if on_step:
            on_step(s.step, "start")
        touched = apply_events(pool, trace, s.step, refcount, flight.double_free)
        for blk in flight.before_step.get(s.step, ()):
            pool.data[pool.index(blk)] = float("nan")
            touched.append(pool.index(blk))
        if touched:
            before = pool.checksum()
        shared = np.array([blk for blk, n in refcount.items() if n > 1], dtype=np.int64)
        b = build_step(s, rows, m.page_size, GUARD_PAGES, shared)
        slots = truth.admit(b)
        ref_arrays, groups = reference_arrays(b, slots)
        runs = run_arrays(b)
        dv = stage.upload(device_arrays(b, slots) | ref_arrays | runs,
                          host=("kv_indptr", "last_page_len", "xqa_indptr",
                                "xqa_last_page_len", *runs))
        code, err, after = _one_step(pool, truth, kernels, b, rows, dv, groups, before, tol,
                                     skip, msgs, m.num_q_heads, rope_rows)
        codes.append(code)
        errs.append(err)
        # the rewind: rejected drafts' slots become poison; only their pages' sums move
        pool.poison_slots(dv["reject_page"], dv["reject_slot"])
        after[dv["reject_page"]] = pool.checksum(dv["reject_page"])
        before = after
        stage.fence()
        truth.release(b)
        if on_step:
            on_step(s.step, "done")
    _collect(res, trace, codes, errs, msgs)
    stats = getattr(kernels, "stats", None)
    if callable(stats):
        res.stats = stats()
    return res


def device_arrays(b: StepBatch, slots: np.ndarray) -> dict[str, np.ndarray]:
    return {"tokens": b.tokens, "rope_pos": b.rope_pos, "true_pos": b.true_pos,
            "row_of_token": b.row_of_token, "append_pos": b.append_pos, "slots": slots,
            "app_row": b.app_row, "app_tokens": b.app_tokens, "app_rope": b.app_rope,
            "kv_indices": b.kv_indices, "kv_indptr": b.kv_indptr, "last_page_len": b.last_page_len,
            "allowed_pages": b.allowed_pages, "engine_write": b.engine_write,
            "write_ok": b.write_ok, "reject_page": b.reject_page, "reject_slot": b.reject_slot,
            "block_table": b.block_table, "kv_len": b.kv_len, "xqa_indptr": b.xqa_indptr,
            "xqa_indices": b.xqa_indices, "xqa_last_page_len": b.xqa_last_page_len}


def _one_step(pool: KVPool, truth: TruthStore, kernels: Kernels, b: StepBatch,
              rows: list[RowRecord], dv: dict[str, torch.Tensor], groups: list,
              before: torch.Tensor, tol: float, skip: dict[int, str], msgs: dict[int, str],
              m_h: int, rope_rows: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dev, dt = pool.data.device, pool.data.dtype
    hkv, d = int(pool.data.shape[3]), int(pool.data.shape[4])
    tok, rope, true_pos = dv["tokens"], dv["rope_pos"], dv["true_pos"]
    truth.write(dv["slots"][dv["row_of_token"]], tok, true_pos)
    fault = torch.full((b.num_rows,), FAULT, device=dev)
    nan_err = torch.full((b.num_rows,), float("nan"), device=dev)
    if b.step in skip:
        msgs[b.step] = skip[b.step]
        return fault, nan_err, pool.checksum()
    at, ar = dv["app_tokens"], dv["app_rope"]
    k, v = content(at, ar, 0, hkv, d, dt, rope_rows), content(at, ar, 1, hkv, d, dt)
    try:
        out = kernels.run_step(pool, b, rows, dv, k, v,
                               content(tok, rope, 2, m_h, d, dt, rope_rows))
    except KernelFault as e:
        msgs[b.step] = str(e)
        return fault, nan_err, pool.checksum()
    ref = reference(truth, dv, groups, content(tok, true_pos, 2, m_h, d, dt))
    after = pool.checksum()
    code, err = row_verdicts(b, dv, out, ref, after != before, tol)
    return code, err, after


def _collect(res: ReplayResult, trace: TraceData, codes: list[torch.Tensor],
             errs: list[torch.Tensor], msgs: dict[int, str]) -> None:
    if not codes:
        return
    code = torch.cat(codes).cpu().numpy()
    err = torch.cat([e.float() for e in errs]).cpu().numpy()
    i = 0
    for s in trace.steps:
        for r in trace.rows[s.step]:
            res.rows.append(RowResult(r.step, r.row, r.request, r.phase, r.q_len,
                                      VERDICTS[int(code[i])], float(err[i]),
                                      msgs.get(r.step, "") if code[i] == FAULT else ""))
            i += 1
    assert i == len(code), "rows and verdicts out of step; this is a bug in the replay loop"


def max_ok_error(res: ReplayResult) -> float:
    vals = [r.err for r in res.rows if r.verdict == "ok"]
    return float(np.max(vals)) if vals else 0.0
