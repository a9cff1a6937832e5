"""Trace rows of one step -> the flat FlashInfer inputs the engine handed its kernels (pure numpy).

Engine page ids are *engine* ids; the pool stores page p at index p + guard, so every id here is
shifted by `guard` before it reaches a kernel (an id of -1 = unallocated/padding lands on the
last left guard page, which is poison).

Flat token order is batch order: token t of row r is `qo_indptr[r] + t`.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from itertools import chain

import numpy as np

from gpu_backend.stepbatch import (  # noqa: F401  (re-exported: the batch is the layout's)
    _FIELDS,
    I32,
    Columns,
    StepBatch,
    assemble,
)
from sim.errors import TraceError
from sim.trace.records import RowRecord, StepRecord

# kv_indices gets TAIL entries of -1 (-> a guard page) past its end: an ordinal the kernels
# follow past the table (FA3 reads, appends, xqa past the row) lands on poison in both
# backends instead of on whatever the allocator placed after the array.
TAIL = 256




# a step's rows as arrays (`columns`, or `TraceData.columns` from the trace's Arrow columns)
SCALARS = ("q_len", "kv_indptr", "committed", "new_tokens", "request", "last_page_len", "kv_len",
           "shared_blocks")
LISTS = ("pages", "alloc", "append_pos", "rope_pos", "tokens")


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


def bad_lengths(q_len: np.ndarray, rope_len: np.ndarray, append_len: np.ndarray,
                tokens_len: np.ndarray) -> np.ndarray:
    """Per row: its lists' lengths contradict it. A device-ahead row appends more K/V than it
    has queries; nothing else may differ."""
    return (rope_len != q_len) | (q_len > append_len) | (append_len != tokens_len)


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
    `compiled`: the per-token work in one numba pass (`gpu_backend.flatten`), else in numpy
    (`flatnumpy.flat_numpy`, the oracle it is tested against).
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
    from gpu_backend import flatten

    out = flatten.run(c["q_len"], c["append_pos_len"], c["append_pos"], c["rope_pos"],
                      c["tokens"], c["committed"], c["alloc"], c["alloc_len"],
                      c["shared_blocks"], c["is_gen"], c["new_tokens"], indptr, ind,
                      np.sort(shared) if len(shared) > 1 else shared, B, guard, TAIL)
    return dict(zip(_FLAT, out, strict=True))


def _steady_runs(c: Columns) -> tuple[tuple[int, int, str], ...]:
    """`_runs`, the steady step's one run found by a compiled pass (`flatten.one_width`)."""
    from gpu_backend import flatten

    return width_runs(flatten.one_width(c["is_ctx"], c["q_len"]), c)


def width_runs(w: int, c: Columns) -> tuple[tuple[int, int, str], ...]:
    """`_runs` of rows whose one query width is w (`flatten.one_width`; -1: none)."""
    if w < 0:
        return _runs(c["is_ctx"], c["q_len"])
    return ((0, len(c["q_len"]), _KINDS[1 if w == 1 else 2]),)


def _flat_numpy(c: Columns, indptr: np.ndarray, ind: np.ndarray, shared: np.ndarray,
                B: int, guard: int) -> dict[str, np.ndarray]:
    from gpu_backend.flatnumpy import flat_numpy

    return flat_numpy(c, indptr, ind, shared, B, guard)


# the arrays `flatnumpy.flat_numpy` and `flatten.flatten` return, in this order
_FLAT = ("qo_indptr", "kv_indices", "row_of_token", "true_pos", "tokens", "app_row", "app_rope",
         "engine_write", "write_ok", "allowed_pages", "reject_page", "reject_slot")


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


def run_arrays(b: StepBatch) -> dict[str, np.ndarray]:
    """Per launch run i: its qo_indptr from 0 (`run{i}_qo`), for the planners."""
    return {f"run{i}_qo": b.qo_indptr[s: e + 1] - b.qo_indptr[s]
            for i, (s, e, _) in enumerate(launch_runs(b))}


def kernel_arrays(b: StepBatch) -> dict[str, np.ndarray]:
    """The kernels' inputs (`device_arrays` + seq_lens; the truth's are
    `prepare.prepare_step`'s)."""
    from gpu_backend import prepk  # numba: loaded where a replay prepares, as `flatten`

    out = device_arrays(b)
    seq = [("seq_lens", b.kv_indptr, b.last_page_len)]
    if b.backend == "xqa":
        seq.append(("xqa_seq_lens", b.xqa_indptr, b.xqa_last_page_len))
    for name, indptr, last in seq:  # FlashInfer's get_seq_lens
        out[name] = prepk.seq_lens(indptr, last, b.page_size)
    return out


def device_arrays(b: StepBatch) -> dict[str, np.ndarray]:
    """The arrays the kernels read (the truth's true_pos is `prepare.prepare_step`'s). Not the
    tokens and positions themselves: the content reads them mod M (`truthprep.content_arrays`),
    and a 64 x 2k prompts' step staged 5 x 131k words of them (tokens, rope_pos, row_of_token,
    app_tokens, app_rope) that nothing read. The block table and the kv lengths only for XQA,
    the one backend whose launches read them (`replay._xqa`, `_attend`): a generation step
    staged five arrays (two empty) that nothing read."""
    out = {"append_pos": b.append_pos, "app_row": b.app_row, "kv_indices": b.kv_indices,
           "kv_indptr": b.kv_indptr, "last_page_len": b.last_page_len}
    if b.backend == "xqa":
        out |= {"block_table": b.block_table, "kv_len": b.kv_len, "xqa_indptr": b.xqa_indptr,
                "xqa_indices": b.xqa_indices, "xqa_last_page_len": b.xqa_last_page_len}
    return out
