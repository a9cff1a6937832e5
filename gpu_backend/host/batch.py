"""One step's flat kernel inputs and truth (`StepBatch`), as `layout.build_step` and
`prepare` make it (`assemble`).
"""

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


@dataclass(frozen=True)
class RefGroup:
    """Rows whose fp32 reference is one batched attention: R rows x W queries over L keys.
    s0 >= 0: their truth slots are s0.. s0+R-1 (views, no gather). Keys below `lo` are visible
    to every query (only [lo, L) is masked). identity: the group is the whole step in token
    order (q and the output need no gather); else `span` = (start, stop) when its tokens are one
    contiguous run in order, or None (index arrays `{pre}src`/`{pre}dst`). The queries are
    `{pre}tok` gathered, or a view of the step's (`view`)."""
    pre: str
    R: int
    W: int
    L: int
    s0: int
    lo: int
    identity: bool
    span: tuple[int, int] | None
    # context rows of any lengths in one launch (`ref_groups(together=)`,
    # `reference_triton.attend_rows`):
    # `{pre}rows` [3, R] holds each row's first token, queries and committed keys; q and the
    # output are the step's own, by token
    ragged: bool = False
    # a context row alone: its limits (committed + j) are the step's true positions over
    # `span`, which the step stages anyway, not `{pre}limit` (`reference.group_limit`)
    true_limit: bool = False

    @property
    def view(self) -> bool:
        """The group's queries and outputs are the step's own in order, [R * W] from span[0]:
        no `{pre}tok` gather, and the reference writes the step's output in place. A context
        row's group (a prompts' step has one a row: 64 gathers and 64 copies of its 2k
        queries' outputs at 64 x 2k)."""
        return self.identity or (self.R == 1 and self.span is not None)


# a step's rows as arrays (`columns`, or `TraceData.columns` from the trace's Arrow columns)
SCALARS = ("q_len", "kv_indptr", "committed", "new_tokens", "request", "last_page_len", "kv_len",
           "shared_blocks")
LISTS = ("pages", "alloc", "append_pos", "rope_pos", "tokens")


def bad_lengths(q_len: np.ndarray, rope_len: np.ndarray, append_len: np.ndarray,
                tokens_len: np.ndarray) -> np.ndarray:
    """Per row: its lists' lengths contradict it. A device-ahead row appends more K/V than it
    has queries; nothing else may differ."""
    return (rope_len != q_len) | (q_len > append_len) | (append_len != tokens_len)


def launch_runs(b: StepBatch) -> list[tuple[int, int, str]]:
    """Maximal runs [s, e) of rows one kernel launches: 'decode' (gen, q_len 1) | 'verify' |
    'ctx'. Both backends split a step the same way."""
    return list(b.runs) if b.runs else list(_runs(b.is_ctx, b.q_len))


_KINDS = ("ctx", "decode", "verify")


def _runs(is_ctx: np.ndarray, q_len: np.ndarray) -> tuple[tuple[int, int, str], ...]:
    """`launch_runs` of rows: the kinds' change points found in numpy (a 64-row step walked in
    Python took ~20 µs, this ~12). The steady step, gen rows of one width, is one run, found
    first in ~2 µs."""
    if len(q_len) and not is_ctx.any() and (q_len == q_len[0]).all():
        return ((0, len(q_len), _KINDS[1 if q_len[0] == 1 else 2]),)
    if len(q_len) and is_ctx.all():  # a prompts' step: 2 µs against ~45
        return ((0, len(q_len), _KINDS[0]),)
    kind = np.where(is_ctx, 0, np.where(q_len == 1, 1, 2))
    cut = np.flatnonzero(np.diff(kind)) + 1
    starts = np.concatenate([[0], cut]).tolist() if len(kind) else []
    ends = np.concatenate([cut, [len(kind)]]).tolist() if len(kind) else []
    return tuple((s, e, _KINDS[k]) for s, e, k in zip(starts, ends, kind[starts].tolist(),
                                                      strict=True))


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

# ("nan", i, 0, 0): poison the pages of array ev{i}; ("copy", dst, src, n): copy n slots
PoolOp = tuple[str, int, int, int]
