"""Trace rows of one step -> the flat FlashInfer inputs the engine handed its kernels (pure numpy).

Engine page ids are *engine* ids; the pool stores page p at index p + guard, so every id here is
shifted by `guard` before it reaches a kernel (an id of -1 = unallocated/padding lands on the
last left guard page, which is poison).

Flat token order is batch order: token t of row r is `qo_indptr[r] + t`.

`layout.build_step`'s per-token and per-page work in numpy: the definition the compiled pass
(`gpu_backend.host.layout_jit`) is held to (tests/unit/test_flatten.py), and
`build_step(compiled=False)`.

A prompts' step's batch before its pages (`prompts_batch`): what its content and reference
read, so that `prepare` queues those launches before it makes the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import lru_cache
from itertools import chain
from typing import Any

import numpy as np

from gpu_backend.host import layout_jit, prepare_jit
from gpu_backend.host.batch import (
    _KINDS,
    I32,
    LISTS,
    SCALARS,
    Columns,
    StepBatch,
    _runs,
    assemble,
    bad_lengths,
    launch_runs,
)
from gpu_backend.host.truth import member
from sim.errors import TraceError
from sim.trace.records import RowRecord, StepRecord

# kv_indices gets TAIL entries of -1 (-> a guard page) past its end: an ordinal the kernels
# follow past the table (FA3 reads, appends, xqa past the row) lands on poison in both
# backends instead of on whatever the allocator placed after the array.
TAIL = 256


def columns(rows: list[RowRecord]) -> Columns:
    """The rows as `build_step` reads them: each of SCALARS per row (int64), is_ctx / is_gen,
    and each of LISTS end to end (int64) with its per-row lengths (`{name}_len`)."""
    c = {k: np.array([getattr(r, k) for r in rows], dtype=np.int64) for k in SCALARS}
    c["is_ctx"] = np.array([r.phase == "ctx" for r in rows], dtype=bool)
    c["is_gen"] = np.array([r.phase == "gen" for r in rows], dtype=bool)
    for k in LISTS:
        c[k + "_len"] = np.array([len(getattr(r, k)) for r in rows], dtype=np.int64)
        c[k] = _flat((getattr(r, k) for r in rows), int(c[k + "_len"].sum()))
    return c


def _fits(rows: list[RowRecord], c: Columns) -> bool:
    """Columns of as many rows, each list as long as its lengths say (a trace's rows are never
    edited after loading; this keeps mismatched columns from being used)."""
    return len(c["q_len"]) == len(rows) and all(
        len(c[k]) == int(c[k + "_len"].sum()) for k in LISTS)


def _ragged(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, index within the row) of every entry of lists of these lengths, end to end."""
    row = np.repeat(np.arange(len(lens)), lens)
    return row, np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)


def _flat_indices(c: Columns, backend: str) -> tuple[np.ndarray, np.ndarray]:
    """The engine's flat kv_indices and indptr. For xqa the CSR is the block table's rows laid end
    to end (row r at r * width), which is how an append addresses a block table."""
    pages, lens = c["pages"], c["pages_len"]
    if backend == "xqa":
        width = int(lens.max(initial=0))
        ind = np.full(len(lens) * width, -1, dtype=np.int64)
        row, col = _ragged(lens)
        ind[row * width + col] = pages
        return np.arange(len(lens) + 1, dtype=np.int64) * width, ind
    # Same flat array as sim.check.access: the rows' pages end to end, indptr from the trace.
    starts = c["kv_indptr"]
    indptr = np.empty(len(starts) + 1, np.int64)  # np.append: ~3x the host time
    indptr[:-1] = starts
    indptr[-1] = starts[-1] + lens[-1] if len(lens) else 0
    return indptr, pages


def _xqa_csr(c: Columns, backend: str, ind: np.ndarray, starts: np.ndarray,
             B: int, guard: int) -> tuple[np.ndarray, ...]:
    """(xqa_indptr, xqa_indices as pool indices, xqa_last_page_len), int32."""
    R = len(c["q_len"])
    if backend != "xqa":
        return _no_xqa(R)
    ind = np.concatenate([ind, np.full(TAIL, -1, dtype=np.int64)])  # the table's tail
    kv = c["kv_len"]
    nb = np.maximum(-(-kv // B), 1)
    ptr = np.concatenate([[0], np.cumsum(nb)])
    row = np.repeat(np.arange(R), nb)
    col = np.arange(int(ptr[-1])) - ptr[row]
    flat = np.minimum(starts[row] + col, len(ind) - 1)
    return (ptr.astype(I32), (ind[flat] + guard).astype(I32),
            np.maximum(kv - (nb - 1) * B, 1).astype(I32))


@lru_cache(maxsize=16)
def _no_xqa(R: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_xqa_csr` of a step of R rows on another backend: what nothing reads, shared between
    steps (read-only) instead of built a step."""
    out = np.zeros(R + 1, I32), np.zeros(0, I32), np.ones(R, I32)
    for a in out:
        a.setflags(write=False)
    return out


def _flat(lists: Iterable[tuple[int, ...]], count: int = -1) -> np.ndarray:
    """Int tuples end to end as int64 (`columns`: the rows' lists when no Arrow columns fit).
    chain walks the tuples in C: a nested generator expression took ~1 ms a step at batch 64,
    kv 2k (two lists per row)."""
    return np.fromiter(chain.from_iterable(lists), np.int64, count)


def _block_table(c: Columns, guard: int) -> np.ndarray:
    lens = c["pages_len"]
    width = int(lens.max(initial=1))
    bt = np.full((len(lens), max(width, 1)), -1, dtype=np.int64)
    bt[np.arange(bt.shape[1]) < lens[:, None]] = c["pages"]  # row-major fill
    return (bt + guard).astype(I32)


def _check_lengths(rows: list[RowRecord], c: Columns) -> None:
    bad = bad_lengths(c["q_len"], c["rope_pos_len"], c["append_pos_len"], c["tokens_len"])
    if bad.any():
        r = rows[int(np.argmax(bad))]
        raise TraceError(f"step {r.step} row {r.row}: tokens/append_pos/rope_pos lengths "
                         f"{len(r.tokens)}/{len(r.append_pos)}/{len(r.rope_pos)} do not fit "
                         f"q_len {r.q_len}")


def build_step(step: StepRecord, rows: list[RowRecord], page_size: int, guard: int,
               shared: np.ndarray | None = None, cols: Columns | None = None,
               compiled: bool = True, checked: bool = False) -> StepBatch:
    """Flatten one step. `shared`: engine ids of blocks with more than one holder (from the
    block events): no row may write them, whatever its `shared_blocks` says. `cols`: the rows
    as arrays (`TraceData.columns`), else built from the rows' tuples (`columns`).
    `compiled`: the per-token work in one numba pass (`gpu_backend.host.layout_jit`), else in numpy
    (`layout.flat_numpy`, the oracle it is tested against).
    `checked`: `cols` are the trace's, which fit the rows and passed the lengths check when it
    loaded (`TraceData.checked`).
    Raises TraceError when a row contradicts itself (list lengths)."""
    if not (checked and cols is not None):
        cols = cols if cols is not None and _fits(rows, cols) else columns(rows)
        _check_lengths(rows, cols)
    c = cols
    R = len(rows)
    sh = np.zeros(0, np.int64) if shared is None else shared
    indptr, ind = _flat_indices(c, step.backend)
    f = _flat_compiled(c, indptr, ind, sh, page_size, guard) if compiled else \
        _flat_numpy(c, indptr, ind, sh, page_size, guard)
    xp, xi, xl = _xqa_csr(c, step.backend, ind, indptr, page_size, guard)
    return assemble(step, page_size, guard, c, tuple(f.values()), indptr.astype(I32),
                    c["last_page_len"].astype(I32), c["kv_len"].astype(I32),
                    # only XQA reads a block table: built for every step, it flattened every
                    # row's pages a second time (~0.5 ms of a 3 ms step's preparation at batch
                    # 64 x kv 8k)
                    _block_table(c, guard) if step.backend == "xqa" else
                    np.zeros((R, 0), dtype=I32), (xp, xi, xl),
                    _steady_runs(c) if compiled else _runs(c["is_ctx"], c["q_len"]))


def _flat_compiled(c: Columns, indptr: np.ndarray, ind: np.ndarray, shared: np.ndarray,
                   B: int, guard: int) -> dict[str, np.ndarray]:
    out = layout_jit.run(c["q_len"], c["append_pos_len"], c["append_pos"], c["rope_pos"],
                      c["tokens"], c["committed"], c["alloc"], c["alloc_len"],
                      c["shared_blocks"], c["is_gen"], c["new_tokens"], indptr, ind,
                      np.sort(shared) if len(shared) > 1 else shared, B, guard, TAIL)
    return dict(zip(_FLAT, out, strict=True))


def _steady_runs(c: Columns) -> tuple[tuple[int, int, str], ...]:
    """`_runs`, the steady step's one run found by a compiled pass (`layout_jit.one_width`)."""
    return width_runs(layout_jit.one_width(c["is_ctx"], c["q_len"]), c)


def width_runs(w: int, c: Columns) -> tuple[tuple[int, int, str], ...]:
    """`_runs` of rows whose one query width is w (`layout_jit.one_width`; -1: none)."""
    if w < 0:
        return _runs(c["is_ctx"], c["q_len"])
    return ((0, len(c["q_len"]), _KINDS[1 if w == 1 else 2]),)


def _flat_numpy(c: Columns, indptr: np.ndarray, ind: np.ndarray, shared: np.ndarray,
                B: int, guard: int) -> dict[str, np.ndarray]:

    return flat_numpy(c, indptr, ind, shared, B, guard)


# the arrays `layout.flat_numpy` and `layout_jit.flatten` return, in this order
_FLAT = ("qo_indptr", "kv_indices", "row_of_token", "true_pos", "tokens", "app_row", "app_rope",
         "engine_write", "write_ok", "allowed_pages", "reject_page", "reject_slot")


def run_arrays(b: StepBatch) -> dict[str, np.ndarray]:
    """Per launch run i: its qo_indptr from 0 (`run{i}_qo`), for the planners."""
    return {f"run{i}_qo": b.qo_indptr[s: e + 1] - b.qo_indptr[s]
            for i, (s, e, _) in enumerate(launch_runs(b))}


def kernel_arrays(b: StepBatch) -> dict[str, np.ndarray]:
    """The kernels' inputs (`device_arrays` + seq_lens; the truth's are
    `prepare.prepare_step`'s)."""
    out = device_arrays(b)
    seq = [("seq_lens", b.kv_indptr, b.last_page_len)]
    if b.backend == "xqa":
        seq.append(("xqa_seq_lens", b.xqa_indptr, b.xqa_last_page_len))
    for name, indptr, last in seq:  # FlashInfer's get_seq_lens
        out[name] = prepare_jit.seq_lens(indptr, last, b.page_size)
    return out


def device_arrays(b: StepBatch) -> dict[str, np.ndarray]:
    """The arrays the kernels read (the truth's true_pos is `prepare.prepare_step`'s). Not the
    tokens and positions themselves: the content reads them mod M (`truth.content_arrays`),
    and a 64 x 2k prompts' step staged 5 x 131k words of them (tokens, rope_pos, row_of_token,
    app_tokens, app_rope) that nothing read. The block table and the kv lengths only for XQA,
    the one backend whose launches read them (`flashinfer._xqa`, `_attend`): a generation step
    staged five arrays (two empty) that nothing read."""
    out = {"append_pos": b.append_pos, "app_row": b.app_row, "kv_indices": b.kv_indices,
           "kv_indptr": b.kv_indptr, "last_page_len": b.last_page_len}
    if b.backend == "xqa":
        out |= {"block_table": b.block_table, "kv_len": b.kv_len, "xqa_indptr": b.xqa_indptr,
                "xqa_indices": b.xqa_indices, "xqa_last_page_len": b.xqa_last_page_len}
    return out


def flat_numpy(c: Columns, indptr: np.ndarray, ind: np.ndarray, shared: np.ndarray,
                B: int, guard: int) -> dict[str, np.ndarray]:
    R = len(c["q_len"])
    q_len = c["q_len"]
    qo = np.concatenate([[0], np.cumsum(q_len)]).astype(I32)
    ind = np.concatenate([ind, np.full(TAIL, -1, dtype=np.int64)])
    row_of_token = np.repeat(np.arange(R), q_len).astype(I32)
    a_len = c["append_pos_len"]
    app_row, j_app = _ragged(a_len)
    app_row = app_row.astype(I32)
    app = c["append_pos"]
    # Append addresses indices[indptr[b] + pos // B] with no bounds check (docs/design.md §3.5).
    slot = indptr[app_row] + app // B
    inside = (slot >= 0) & (slot < len(ind))
    eng = np.where(inside, ind[np.clip(slot, 0, max(len(ind) - 1, 0))] if len(ind) else -1, -1)
    eng = np.where(inside & (eng >= -guard), eng + guard, -1).astype(np.int64)
    committed = c["committed"]
    true_pos = np.repeat(committed, q_len) + (np.arange(int(qo[-1])) - np.repeat(qo[:-1], q_len))
    allowed, write_ok, rej_p, rej_s = truth_writes(
        c, B, guard, app_row, np.repeat(committed, a_len) + j_app, eng, shared)
    # a row's first q_len appends are its queries; K of the extra (device-ahead) appends is
    # built at their append position
    is_q = j_app < q_len[app_row]
    app_rope = app.copy()
    app_rope[is_q] = c["rope_pos"]
    out = (qo, (ind + guard).astype(I32), row_of_token, true_pos, c["tokens"][is_q], app_row,
           app_rope, eng, write_ok, allowed, rej_p, rej_s)
    return dict(zip(_FLAT, out, strict=True))


def truth_writes(c: Columns, B: int, guard: int, row_of_token: np.ndarray,
                  true_pos: np.ndarray, eng: np.ndarray,
                  shared: np.ndarray) -> tuple[np.ndarray, ...]:
    """(allowed pages, write_ok per token, rejected-draft pages, slots), all from the truth:
    token t of row r writes true position committed_r + j into alloc_r[pos // B]; the row may
    write that block unless it is one of its shared prefix blocks."""
    n_alloc, alloc = c["alloc_len"], c["alloc"]
    ptr = np.concatenate([[0], np.cumsum(n_alloc)])
    lead = c["shared_blocks"]
    blk = true_pos // B
    has = blk < n_alloc[row_of_token]
    page = np.where(has, alloc[np.minimum(ptr[row_of_token] + blk, max(len(alloc) - 1, 0))]
                    if len(alloc) else -1, -1)
    page = np.where(page >= 0, page + guard, -1)
    mine = (page >= 0) & (blk >= lead[row_of_token]) & ~np.isin(page - guard, shared)
    # pages of each row's own non-shared blocks, keyed by row: may the engine's write go there?
    # (the definition, over every page of the batch: this is the compiled pass's oracle)
    own_row = np.repeat(np.arange(len(n_alloc)), n_alloc)
    own_ok = (np.arange(len(alloc)) - ptr[own_row] >= lead[own_row]) & (alloc >= 0)
    own_ok &= ~np.isin(alloc, shared)
    big = 1 << 32
    own_keys = np.sort(own_row[own_ok] * big + alloc[own_ok] + guard)
    write_ok = member(row_of_token.astype(np.int64) * big + eng, own_keys) & (eng >= 0)
    gen = c["is_gen"][row_of_token]
    new = c["new_tokens"][row_of_token]
    committed = c["committed"][row_of_token]
    rej = gen & (true_pos - committed >= new) & (page >= 0)
    return (np.unique(page[mine]), write_ok, page[rej], true_pos[rej] % B)


def prompts_batch(step: StepRecord, c: Columns, page_size: int, guard: int,
                  per_token: bool = True) -> StepBatch | None:
    """Step `step` as far as its content and reference read it, before its pages: the rows'
    own fields and the per-token ones are `build_step`'s, the page fields (the engine's table,
    its writes, the truth's pages, the rejected drafts) are empty. `prepare` queues a prompts'
    step's content and reference from it and makes the whole batch after their launches: at
    64 x 2k `build_step` was ~40% of the host's time before the device's first launch.
    Only a step of context rows, each with queries and its appends its queries (as a prompts'
    step's), from columns that passed the lengths check (`TraceData.checked`); else None.
    per_token False: each token's row and true position are None (`token_rows` makes them),
    for a step whose content the device makes from its rows (`truth.row_content`)."""
    q_len = c["q_len"]
    if not len(q_len) or not c["is_ctx"].all() or (q_len <= 0).any() or \
            not np.array_equal(c["append_pos_len"], q_len):
        return None
    R = len(q_len)
    qo = np.zeros(R + 1, dtype=I32)
    np.cumsum(q_len, out=qo[1:])
    i32, i64 = np.zeros(0, dtype=I32), np.zeros(0, dtype=np.int64)
    unmade: Any = None  # made by `token_rows`: a reader before it fails at once
    b = StepBatch(
        step=step.step, backend=step.backend, plan_q_len=step.plan_q_len,
        plan_batch=step.plan_batch, plan_cache_size=step.plan_cache_size, page_size=page_size,
        guard=guard, requests=c["request"], is_ctx=c["is_ctx"], q_len=q_len, qo_indptr=qo,
        kv_indptr=i32, kv_indices=i32, last_page_len=i32, kv_len=i32,
        block_table=np.zeros((R, 0), dtype=I32), row_of_token=unmade, tokens=c["tokens"],
        app_row=unmade, app_tokens=c["tokens"], app_rope=c["rope_pos"], rope_pos=c["rope_pos"],
        append_pos=c["append_pos"], true_pos=unmade, committed=c["committed"],
        new_tokens=c["new_tokens"], allowed_pages=i64, engine_write=i64,
        write_ok=np.zeros(0, dtype=bool), reject_page=i64, reject_slot=i64, xqa_indptr=i32,
        xqa_indices=i32, xqa_last_page_len=i32)
    return token_rows(b) if per_token else b


def token_rows(b: StepBatch) -> StepBatch:
    """`prompts_batch(per_token=False)`'s batch with each token's row and true position."""
    row, true_pos = prepare_jit.token_rows(b.q_len, b.committed)
    return replace(b, row_of_token=row, app_row=row, true_pos=true_pos)
