"""Trace rows of one step -> the flat FlashInfer inputs the engine handed its kernels (pure numpy).

Engine page ids are *engine* ids; the pool stores page p at index p + guard, so every id here is
shifted by `guard` before it reaches a kernel (an id of -1 = unallocated/padding lands on the
last left guard page, which is poison).

Flat token order is batch order: token t of row r is `qo_indptr[r] + t`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

import numpy as np

from sim.errors import TraceError
from sim.trace.records import RowRecord, StepRecord

I32 = np.int32
# kv_indices gets TAIL entries of -1 (-> a guard page) past its end: an ordinal the kernels
# follow past the table (FA3 reads, appends, xqa past the row) lands on poison in both
# backends instead of on whatever the allocator placed after the array.
TAIL = 256


@dataclass(frozen=True)
class StepBatch:
    step: int
    backend: str  # fa2 | fa3 | xqa
    plan_q_len: int  # -1: the decode plan was built for this step (docs/trace.md)
    plan_batch: int  # the step's batch (all rows) when that plan was built
    plan_cache_size: int  # plans the engine's cache holds after this step's launch
    page_size: int
    guard: int
    requests: np.ndarray  # [R] request ids
    is_ctx: np.ndarray  # [R] bool
    q_len: np.ndarray  # [R]
    qo_indptr: np.ndarray  # [R+1] int32
    kv_indptr: np.ndarray  # [R+1] int32, engine CSR (absolute offsets into kv_indices)
    kv_indices: np.ndarray  # [nnz_pages] int32, pool indices (engine id + guard)
    last_page_len: np.ndarray  # [R] int32
    kv_len: np.ndarray  # [R] int32, the length the kernel uses (trace column)
    block_table: np.ndarray  # [R, width] int32 pool indices (xqa; [R, 0] for other backends)
    row_of_token: np.ndarray  # [nnz_q] int32
    tokens: np.ndarray  # [nnz_q] token ids of the queries
    app_row: np.ndarray  # [nnz_a] row of each appended K/V (nnz_a >= nnz_q: device-ahead rows)
    app_tokens: np.ndarray  # [nnz_a]
    app_rope: np.ndarray  # [nnz_a] RoPE position of each appended K
    rope_pos: np.ndarray  # [nnz_q] engine RoPE positions (Q and appended K)
    append_pos: np.ndarray  # [nnz_a] engine append positions
    true_pos: np.ndarray  # [nnz_q] committed + j
    committed: np.ndarray  # [R]
    new_tokens: np.ndarray  # [R]
    allowed_pages: np.ndarray  # pool indices this step may write (truth, non-shared)
    engine_write: np.ndarray  # [nnz_a] pool index the engine's append targets (-1: wild)
    write_ok: np.ndarray  # [nnz_a] bool: that page is one the row itself may write (truth)
    reject_page: np.ndarray  # pool indices of rejected-draft slots (truth), with reject_slot
    reject_slot: np.ndarray
    # xqa as CSR: row r reads table[r, p // B] for p < kv_len (past the row: the next row's
    # entries, as XQA's row stride does), so FA2 over this CSR reads exactly XQA's pages
    xqa_indptr: np.ndarray  # [R+1]
    xqa_indices: np.ndarray  # pool indices
    xqa_last_page_len: np.ndarray  # [R]
    # `launch_runs`, built with the step (the replay asks for it every step: host time)
    runs: tuple[tuple[int, int, str], ...] = ()

    @property
    def num_rows(self) -> int:
        return int(self.q_len.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def _flat_indices(rows: list[RowRecord], backend: str,
                  pages: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The engine's flat kv_indices and indptr. For xqa the CSR is the block table's rows laid end
    to end (row r at r * width), which is how an append addresses a block table."""
    if backend == "xqa":
        width = max((len(r.pages) for r in rows), default=0)
        ind = np.full(len(rows) * width, -1, dtype=np.int64)
        for i, r in enumerate(rows):
            ind[i * width: i * width + len(r.pages)] = r.pages
        return np.arange(len(rows) + 1, dtype=np.int64) * width, ind
    # Same flat array as sim.check.access: the rows' pages end to end, indptr from the trace.
    starts = np.array([r.kv_indptr for r in rows], dtype=np.int64)
    ind = _flat(r.pages for r in rows) if pages is None else pages
    end = starts[-1] + len(rows[-1].pages) if rows else 0
    return np.append(starts, end), ind


def _xqa_csr(rows: list[RowRecord], backend: str, ind: np.ndarray, starts: np.ndarray,
             B: int) -> tuple[np.ndarray, ...]:
    if backend != "xqa":
        z = np.zeros(1, np.int64)
        return np.zeros(len(rows) + 1, np.int64), z[:0], np.ones(len(rows), np.int64)
    kv = np.array([r.kv_len for r in rows], dtype=np.int64)
    nb = np.maximum(-(-kv // B), 1)
    ptr = np.concatenate([[0], np.cumsum(nb)])
    row = np.repeat(np.arange(len(rows)), nb)
    col = np.arange(int(ptr[-1])) - ptr[row]
    flat = np.minimum(starts[row] + col, len(ind) - 1)  # the table's tail entries are -1
    return ptr, ind[flat], np.maximum(kv - (nb - 1) * B, 1)


def _flat(lists: Iterable[tuple[int, ...]], count: int = -1) -> np.ndarray:
    """Page-id tuples end to end as int64. chain walks the tuples in C: a nested generator
    expression took ~1 ms a step at batch 64, kv 2k (two lists per row)."""
    return np.fromiter(chain.from_iterable(lists), np.int64, count)


def _member(x: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """np.isin(x, sorted_keys) for sorted keys: one binary search per value, no sort of both."""
    if not len(sorted_keys):
        return np.zeros(len(x), dtype=bool)
    i = np.minimum(np.searchsorted(sorted_keys, x), len(sorted_keys) - 1)
    return sorted_keys[i] == x


def _block_table(rows: list[RowRecord], guard: int) -> np.ndarray:
    lens = np.fromiter((len(r.pages) for r in rows), np.int64, len(rows))
    width = int(lens.max(initial=1))
    bt = np.full((len(rows), max(width, 1)), -1, dtype=np.int64)
    bt[np.arange(bt.shape[1]) < lens[:, None]] = _flat(r.pages for r in rows)  # row-major fill
    return (bt + guard).astype(I32)


def _truth_writes(rows: list[RowRecord], B: int, guard: int, row_of_token: np.ndarray,
                  true_pos: np.ndarray, eng: np.ndarray, shared: np.ndarray,
                  flat_alloc: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """(allowed pages, write_ok per token, rejected-draft pages, slots), all from the truth:
    token t of row r writes true position committed_r + j into alloc_r[pos // B]; the row may
    write that block unless it is one of its shared prefix blocks."""
    n_alloc = np.array([len(r.alloc) for r in rows], dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum(n_alloc)])
    alloc = _flat((r.alloc for r in rows), int(ptr[-1])) if flat_alloc is None else flat_alloc
    lead = np.array([r.shared_blocks for r in rows], dtype=np.int64)
    blk = true_pos // B
    has = blk < n_alloc[row_of_token]
    page = np.where(has, alloc[np.minimum(ptr[row_of_token] + blk, max(len(alloc) - 1, 0))]
                    if len(alloc) else -1, -1)
    page = np.where(page >= 0, page + guard, -1)
    mine = (page >= 0) & (blk >= lead[row_of_token]) & ~np.isin(page - guard, shared)
    # pages of each row's own non-shared blocks, keyed by row: may the engine's write go there?
    own_row = np.repeat(np.arange(len(rows)), n_alloc)
    own_ok = (np.arange(len(alloc)) - ptr[own_row] >= lead[own_row]) & (alloc >= 0)
    own_ok &= ~np.isin(alloc, shared)
    big = 1 << 32
    own_keys = np.sort(own_row[own_ok] * big + alloc[own_ok] + guard)
    write_ok = _member(row_of_token.astype(np.int64) * big + eng, own_keys) & (eng >= 0)
    gen = np.array([r.phase == "gen" for r in rows])[row_of_token]
    new = np.array([r.new_tokens for r in rows], dtype=np.int64)[row_of_token]
    committed = np.array([r.committed for r in rows], dtype=np.int64)[row_of_token]
    rej = gen & (true_pos - committed >= new) & (page >= 0)
    return (np.unique(page[mine]), write_ok, page[rej], true_pos[rej] % B)


def build_step(step: StepRecord, rows: list[RowRecord], page_size: int, guard: int,
               shared: np.ndarray | None = None,
               lists: dict[str, np.ndarray] | None = None) -> StepBatch:
    """Flatten one step. `shared`: engine ids of blocks with more than one holder (from the
    block events): no row may write them, whatever its `shared_blocks` says. `lists`: the rows'
    pages and alloc end to end (`TraceData.lists`), else flattened from the rows' tuples.
    Raises TraceError when a row contradicts itself (list lengths)."""
    lists = lists if lists is not None and _fits(rows, lists) else {}
    for r in rows:  # a device-ahead row appends more K/V than it has queries
        if not (len(r.rope_pos) == r.q_len <= len(r.append_pos) == len(r.tokens)):
            raise TraceError(f"step {r.step} row {r.row}: tokens/append_pos/rope_pos lengths "
                             f"{len(r.tokens)}/{len(r.append_pos)}/{len(r.rope_pos)} do not fit "
                             f"q_len {r.q_len}")
    q_len = np.array([r.q_len for r in rows], dtype=np.int64)
    qo = np.concatenate([[0], np.cumsum(q_len)]).astype(I32)
    indptr, ind = _flat_indices(rows, step.backend, lists.get("pages"))
    ind = np.concatenate([ind, np.full(TAIL, -1, dtype=np.int64)])
    row_of_token = np.repeat(np.arange(len(rows)), q_len).astype(I32)
    a_len = np.array([len(r.append_pos) for r in rows], dtype=np.int64)
    app_row = np.repeat(np.arange(len(rows)), a_len).astype(I32)
    app = np.concatenate([list(r.append_pos) for r in rows] or [[]]).astype(np.int64)
    j_app = np.arange(len(app)) - np.repeat(np.cumsum(a_len) - a_len, a_len)
    # Append addresses indices[indptr[b] + pos // B] with no bounds check (reference §3).
    slot = indptr[app_row] + app // page_size
    inside = (slot >= 0) & (slot < len(ind))
    eng = np.where(inside, ind[np.clip(slot, 0, max(len(ind) - 1, 0))] if len(ind) else -1, -1)
    eng = np.where(inside & (eng >= -guard), eng + guard, -1)
    xp, xi, xl = _xqa_csr(rows, step.backend, ind, indptr, page_size)
    committed = np.array([r.committed for r in rows], dtype=np.int64)
    true_pos = np.repeat(committed, q_len) + (np.arange(int(qo[-1])) - np.repeat(qo[:-1], q_len))
    eng = eng.astype(np.int64)
    allowed, write_ok, rej_p, rej_s = _truth_writes(
        rows, page_size, guard, app_row, np.repeat(committed, a_len) + j_app, eng,
        np.zeros(0, np.int64) if shared is None else shared, lists.get("alloc"))
    toks = np.concatenate([list(r.tokens) for r in rows] or [[]]).astype(np.int64)
    # K of the extra (device-ahead) appends is built at their append position
    app_rope = np.concatenate([list(r.rope_pos) + list(r.append_pos[r.q_len:])
                               for r in rows] or [[]]).astype(np.int64)
    return StepBatch(
        step=step.step, backend=step.backend, plan_q_len=step.plan_q_len,
        plan_batch=step.plan_batch, plan_cache_size=step.plan_cache_size, page_size=page_size,
        guard=guard,
        requests=np.array([r.request for r in rows], dtype=np.int64),
        is_ctx=np.array([r.phase == "ctx" for r in rows], dtype=bool),
        q_len=q_len, qo_indptr=qo, kv_indptr=indptr.astype(I32),
        kv_indices=(ind + guard).astype(I32),
        last_page_len=np.array([r.last_page_len for r in rows], dtype=I32),
        kv_len=np.array([r.kv_len for r in rows], dtype=I32),
        # only XQA reads a block table: built for every step, it flattened every row's pages a
        # second time (~0.5 ms of a 3 ms step's preparation at batch 64 x kv 8k)
        block_table=_block_table(rows, guard) if step.backend == "xqa" else
        np.zeros((len(rows), 0), dtype=I32), row_of_token=row_of_token,
        tokens=np.concatenate([list(r.tokens[: r.q_len]) for r in rows] or [[]]).astype(np.int64),
        app_row=app_row, app_tokens=toks, app_rope=app_rope,
        rope_pos=np.concatenate([list(r.rope_pos) for r in rows] or [[]]).astype(np.int64),
        append_pos=app,
        true_pos=true_pos,
        committed=committed, new_tokens=np.array([r.new_tokens for r in rows], dtype=np.int64),
        allowed_pages=allowed, engine_write=eng, write_ok=write_ok,
        xqa_indptr=xp.astype(I32), xqa_indices=(xi + guard).astype(I32),
        xqa_last_page_len=xl.astype(I32),
        reject_page=rej_p, reject_slot=rej_s,
        runs=tuple(_runs([r.phase == "ctx" for r in rows], q_len.tolist())))


def _fits(rows: list[RowRecord], lists: dict[str, np.ndarray]) -> bool:
    """The lists hold as many entries as the rows' tuples (a trace's rows are never edited
    after loading; this keeps a caller's edited rows from pairing with stale lists)."""
    return all(len(lists[k]) == sum(len(getattr(r, k)) for r in rows) for k in lists)


def launch_runs(b: StepBatch) -> list[tuple[int, int, str]]:
    """Maximal runs [s, e) of rows one kernel launches: 'decode' (gen, q_len 1) | 'verify' |
    'ctx'. Both backends split a step the same way."""
    return list(b.runs) if b.runs else _runs(b.is_ctx.tolist(), b.q_len.tolist())


def _runs(is_ctx: list[bool], q_len: list[int]) -> list[tuple[int, int, str]]:
    kind = ["ctx" if c else ("decode" if q == 1 else "verify")
            for c, q in zip(is_ctx, q_len, strict=True)]
    out: list[tuple[int, int, str]] = []
    for i, k in enumerate(kind):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], i + 1, k)
        else:
            out.append((i, i + 1, k))
    return out


def stale_plan(b: StepBatch, s: int, e: int, kind: str) -> tuple[int, int] | None:
    """(batch, q_len) of the decode plan that launch run [s, e) of `kind` runs with, when the
    engine reused a plan built for another shape; None when the run is planned for itself.

    The trace records the plan's query width (`plan_q_len`, -1: built for this step) and the
    step's batch when it was built (`plan_batch`, all rows: I14 compares it with the step's row
    count). A decode plan covers the run's rows, so its batch is the run's rows plus the
    difference. Context runs have their own prefill plan."""
    if b.plan_q_len < 0 or kind == "ctx":
        return None
    batch = (e - s) + b.plan_batch - b.num_rows
    if (b.plan_q_len, batch) == (int(b.q_len[s]), e - s):
        return None
    return max(batch, 1), b.plan_q_len


def run_arrays(b: StepBatch) -> dict[str, np.ndarray]:
    """Per launch run i: its qo_indptr from 0 (`run{i}_qo`), for the planners."""
    return {f"run{i}_qo": b.qo_indptr[s: e + 1] - b.qo_indptr[s]
            for i, (s, e, _) in enumerate(launch_runs(b))}
