"""One step's flat kernel inputs and truth (`StepBatch`), as `layout.build_step` and
`steadystep` make it (`assemble`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from sim.trace.records import StepRecord

I32 = np.int32
# a step's rows as arrays (`layout.columns`, or `TraceData.columns` from the trace's Arrow
# columns)
Columns = dict[str, np.ndarray]


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


_FIELDS = tuple(f.name for f in fields(StepBatch))


def assemble(step: StepRecord, page_size: int, guard: int, c: Columns,
             flat: tuple[np.ndarray, ...], kv_indptr: np.ndarray, last_page_len: np.ndarray,
             kv_len: np.ndarray, block_table: np.ndarray, xqa: tuple[np.ndarray, ...],
             runs: tuple[tuple[int, int, str], ...]) -> StepBatch:
    """Step's StepBatch from its columns and the flat arrays (`_FLAT`'s, in that order), without
    the frozen dataclass's __init__, which sets its fields one `object.__setattr__` at a time
    (~14 of a generation step's ~90 µs here on a development machine): one dict display, in
    field order (tests/unit/test_flatten.py holds it to `_FIELDS`), not keywords gathered into
    a dict and copied again (~3 µs more)."""
    (qo, kv_indices, row_of_token, true_pos, tokens, app_row, app_rope, engine_write, write_ok,
     allowed, reject_page, reject_slot) = flat
    b = object.__new__(StepBatch)
    b.__dict__.update({
        "step": step.step, "backend": step.backend, "plan_q_len": step.plan_q_len,
        "plan_batch": step.plan_batch, "plan_cache_size": step.plan_cache_size,
        "page_size": page_size, "guard": guard, "requests": c["request"], "is_ctx": c["is_ctx"],
        "q_len": c["q_len"], "qo_indptr": qo, "kv_indptr": kv_indptr, "kv_indices": kv_indices,
        "last_page_len": last_page_len, "kv_len": kv_len, "block_table": block_table,
        "row_of_token": row_of_token, "tokens": tokens, "app_row": app_row,
        "app_tokens": c["tokens"], "app_rope": app_rope, "rope_pos": c["rope_pos"],
        "append_pos": c["append_pos"], "true_pos": true_pos, "committed": c["committed"],
        "new_tokens": c["new_tokens"], "allowed_pages": allowed, "engine_write": engine_write,
        "write_ok": write_ok, "reject_page": reject_page, "reject_slot": reject_slot,
        "xqa_indptr": xqa[0], "xqa_indices": xqa[1], "xqa_last_page_len": xqa[2],
        "runs": runs})
    return b
