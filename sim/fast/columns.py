"""Kernel buffers -> trace columns (docs/trace.md, schema order) and, on demand, records."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba as nb
import numpy as np
import pyarrow as pa

from sim.fast import fields as fl
from sim.trace.records import BlockEvent, RequestRecord, RowRecord, StepRecord, Violation
from sim.trace.writer import from_numpy, strings

if TYPE_CHECKING:
    from sim.fast.engine import FastEngine

_PHASE = ("ctx", "gen")
_EV_PHASE = ("sched", "proc")


@dataclass
class Chunk:
    """One drain of the kernel's buffers, as trace columns (docs/trace.md) in schema order."""
    steps: dict[str, np.ndarray]
    rows: dict[str, object]  # list columns are (offsets int32, values int32); strings Arrow
    blocks: dict[str, np.ndarray]  # phase and event: Arrow strings
    requests: dict[str, object]
    spare_slots: np.ndarray  # per step: reserved - committed - new over rows (kv series)
    # rows' list columns are as stored, with DELTA_COLUMNS and RUN_COLUMNS (FastEngine delta:
    # the trace writer stores them as they are), not whole lists; and the rows' and events'
    # columns are the writer's to keep, not copy (FastEngine._drain hands their buffers over)
    rows_encoded: bool = False


@nb.njit(cache=True, nogil=True)
def _positions(starts, offsets):  # type: ignore[no-untyped-def]
    """values[offsets[i]:offsets[i + 1]] = start[i], start[i] + 1, ... (int32, as stored)."""
    values = np.empty(offsets[-1], np.int32)
    for i in range(len(starts)):
        for j in range(offsets[i], offsets[i + 1]):
            values[j] = starts[i] + j - offsets[i]
    return values


@nb.njit(cache=True, nogil=True)
def _slices(values, starts, offsets):  # type: ignore[no-untyped-def]
    """values[start[i]:start[i] + n] for each row as one array, n from the offsets: the
    requests' tokens (~16M per 10k requests) without int64 index temporaries."""
    out = np.empty(offsets[-1], values.dtype)
    for i in range(len(starts)):
        out[offsets[i]:offsets[i + 1]] = values[starts[i]:starts[i] + offsets[i + 1] - offsets[i]]
    return out


def _c64(a: np.ndarray) -> np.ndarray:
    """One layout for a compiled function's argument: a column of D is strided, except in a
    one-request chunk (numpy calls that contiguous), and numba compiles each layout it meets.
    A compile after warm() can land in the fuzzer's hang guard, whose alarm then broke numba's
    type registry for the rest of the process (tests/unit/test_fast.py)."""
    return np.ascontiguousarray(a, np.int64)


def positions(starts: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, start+n) for each row as a list column (offsets int32, values int32), n from
    the offsets, in one compiled pass, without int64 temporaries."""
    return offsets, _positions(_c64(starts), offsets)


def _listcol(flat: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return offsets, flat[:offsets[-1]]


def chunk_of(eng: FastEngine, D: np.ndarray, only_requests: bool = False) -> Chunk:
    K = eng.K
    S = eng.S[:0 if only_requests else K[fl.K_S]]
    W = eng.W[:0 if only_requests else K[fl.K_R]]
    E = eng.E[:K[fl.K_E] if eng.detail and not only_requests else 0]
    steps = {
        "step": S[:, 0], "t_sched_ns": S[:, 1], "t_launch_ns": S[:, 2],
        "t_dev_start_ns": S[:, 3], "t_dev_end_ns": S[:, 4], "num_rows": S[:, 5],
        "num_ctx": S[:, 6], "num_gen": S[:, 7], "num_tokens": S[:, 8],
        "backend": strings(np.zeros(len(S), np.int64), (eng.sw.backend,)), "plan_q_len": S[:, 9],
        "plan_batch": S[:, 10], "plan_cache_size": S[:, 11], "blocks_used": S[:, 12],
        "blocks_free": S[:, 13], "blocks_cached": S[:, 14], "graph_width": S[:, 15],
        "processed_step": S[:, 0]}  # overlap off: each step is processed before the next
    rows: dict[str, object] = {}
    if eng.detail and len(W):
        q = W[:, fl.W_Q]
        n = len(W)
        zeros, false, max_pos = _constants(n, eng.max_pos, arrow=eng.delta)
        append, rope = _stored_positions(W) if eng.delta else _positions_of(W)
        rows = {
            "step": W[:, fl.W_STEP], "row": W[:, fl.W_ROW], "request": W[:, fl.W_REQ],
            "phase": strings(W[:, fl.W_PHASE], _PHASE), "q_len": q, "draft_len": zeros,
            "first_gen": false, "prev_in_flight": false,
            "pages": _listcol(eng.PG, W[:, fl.W_PTAIL if eng.delta else fl.W_NPAGES]),
            "kv_indptr": W[:, fl.W_KVINDPTR],
            "last_page_len": W[:, fl.W_LPL], "kv_len": W[:, fl.W_KVLEN],
            "append_pos": append, "rope_pos": rope,
            "cached_host": W[:, fl.W_CACHED_HOST], "kv_len_host": W[:, fl.W_KVLEN_HOST],
            "committed": W[:, fl.W_COMMIT],
            "alloc": _listcol(eng.AL, W[:, fl.W_ATAIL if eng.delta else fl.W_NALLOC]),
            "reserved": W[:, fl.W_RESERVED], "shared_blocks": zeros,
            "tokens": _listcol(eng.TK, W[:, fl.W_NTOK]), "accepted": W[:, fl.W_ACCEPTED],
            "new_tokens": W[:, fl.W_NEW], "prev_new_tokens": W[:, fl.W_PREVNEW],
            "max_pos": max_pos}
        if eng.delta:
            has = q > 0  # an empty list's run starts at 0
            rows |= {"prev_row": W[:, fl.W_PREV], "pages_keep": W[:, fl.W_PKEEP],
                     "alloc_keep": W[:, fl.W_AKEEP],
                     "append_pos_start": np.where(has, W[:, fl.W_APPEND], 0),
                     "append_pos_run": q, "rope_pos_start": np.where(has, W[:, fl.W_ROPE], 0),
                     "rope_pos_run": q}
    blocks = {
        "step": E[:, 0], "phase": strings(E[:, 1], _EV_PHASE), "seq": E[:, 2],
        "event": strings(E[:, 3], fl.EVENTS),
        "block": E[:, 4], "request": E[:, 5], "refcount": E[:, 6], "src": E[:, 7],
        "num_tokens": np.zeros(len(E), np.int64), "hash": np.zeros(len(E), np.uint64)}
    return Chunk(steps, rows, blocks, _requests(eng, D), S[:, 17].copy(), eng.delta)


def _positions_of(W: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """append_pos and rope_pos: one list column twice when their starts agree (always here:
    with nothing in flight, a prefill chunk starts at the request's committed tokens)."""
    offsets = _offsets(W[:, fl.W_Q])
    append = positions(W[:, fl.W_APPEND], offsets)
    if np.array_equal(W[:, fl.W_APPEND], W[:, fl.W_ROPE]):
        return append, append
    return append, positions(W[:, fl.W_ROPE], offsets)


def _constants(n: int, max_pos: int, arrow: bool) -> tuple[object, object, object]:
    """The rows' constant columns (zeros, false, max_pos): for the trace writer alone (arrow)
    Arrow arrays over fresh buffers, which it keeps as they are instead of copying."""
    cols = np.zeros(n, np.int64), np.zeros(n, bool), np.full(n, max_pos, np.int64)
    if not arrow:
        return cols
    return tuple(from_numpy(c, t) for c, t in zip(cols, (pa.int64(), pa.bool_(), pa.int64()),
                                                    strict=True))


def _stored_positions(W: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """append_pos and rope_pos as stored from format 3: every row's positions are one run
    (its `_start`, `_run` columns), so nothing is left in the lists."""
    empty = (np.zeros(len(W) + 1, np.int32), np.empty(0, np.int32))
    return empty, empty


def _requests(eng: FastEngine, D: np.ndarray) -> dict[str, object]:
    P, nhost = D[:, fl.D_P], D[:, fl.D_NHOST]
    n_out = np.maximum(P, nhost) - P
    p_off, o_off = _offsets(P), _offsets(n_out)
    zeros = np.zeros(len(D), np.int64)
    reason = D[:, fl.D_REASON]
    t = eng.totals
    t["requests"] += len(D)
    t["finished"] += int(((reason == 1) | (reason == 2)).sum())
    t["rejected"] += int((reason == 3).sum())
    t["output_tokens"] += int(n_out.sum())
    t["prompt_tokens"] += int(P.sum())
    t["gen_steps"] += int(D[:, fl.D_GSTEPS].sum())
    t["preemptions"] += int(D[:, fl.D_NPRE].sum())
    return {
        "request": D[:, fl.D_RID], "arrival_ns": D[:, fl.D_ARR], "prompt_len": P,
        "output_len": D[:, fl.D_O],
        "prompt_tokens": (p_off, _slices(eng.toks, _c64(D[:, fl.D_TOK]), p_off)),
        "output_tokens": (o_off, _slices(eng.toks, _c64(D[:, fl.D_TOK] + P), o_off)),
        "reused_tokens": zeros, "first_token_ns": D[:, fl.D_FIRST], "finish_ns": D[:, fl.D_FIN],
        "finish_reason": strings(reason, fl.REASONS), "num_preemptions": D[:, fl.D_NPRE],
        "num_steps": D[:, fl.D_GSTEPS], "accepted_drafts": zeros, "proposed_drafts": zeros}


def _offsets(lengths: np.ndarray) -> np.ndarray:
    o = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=o[1:])
    return o


def violations_of(eng: FastEngine, V: np.ndarray) -> list[Violation]:
    out = []
    for code, step, rid, x, y in V.tolist():
        if code == fl.V_I18:
            out.append(Violation("I18", step, rid, f"I18 step {step} req {rid}: after processing, "
                                 f"reserved C={x} but N-1={y} with no step in flight"))
        else:
            out.append(Violation(
                "LIVENESS", step, rid, f"LIVENESS step {step} req {rid}: requests are waiting, "
                f"nothing runs or is in flight, and nothing can be scheduled ({x} blocks free)"))
    return out


# -- records (the online checker and in-memory tables read these) ----------------------------
def _pylist(v: object) -> list:
    """A column as Python values: one tolist() per column, tuples for list columns."""
    if isinstance(v, tuple):
        off, vals = v
        flat = vals[off[0]:off[-1]].tolist()
        o = (off - off[0]).tolist()
        return [tuple(flat[o[i]:o[i + 1]]) for i in range(len(o) - 1)]
    if isinstance(v, pa.Array):  # string columns
        return v.to_pylist()
    return v.tolist()  # type: ignore[attr-defined]


def records(cols: Mapping[str, object], cls: type) -> list:
    """Column dict (schema order) -> records, built row-wise from per-column Python lists."""
    return [cls(*row) for row in zip(*(_pylist(v) for v in cols.values()), strict=True)]


Step = tuple[StepRecord, list[RowRecord], list[BlockEvent]]


class StepStream:
    """Chunks -> (step, rows, events) as the reference engine hands them to its sink: a step
    goes with every event emitted from its launch to the next launch, and those can arrive in
    the next chunk, so the last step of a chunk is held back until then."""

    def __init__(self) -> None:
        self.held: Step | None = None

    def feed(self, ch: Chunk) -> list[Step]:
        steps = records(ch.steps, StepRecord)
        rows = records(ch.rows, RowRecord) if ch.rows else []
        by_step: dict[int, list[RowRecord]] = {}
        for r in rows:
            by_step.setdefault(r.step, []).append(r)
        ev_by: dict[int, list[BlockEvent]] = {}
        for e in records(ch.blocks, BlockEvent):
            ev_by.setdefault(e.step, []).append(e)
        out: list[Step] = []
        if self.held is not None:
            self.held[2].extend(ev_by.pop(self.held[0].step, []))
            if steps:
                out.append(self.held)
                self.held = None
        for s in steps:
            out.append((s, by_step.get(s.step, []), ev_by.get(s.step, [])))
        if out and self.held is None:
            self.held = out.pop()
        return out

    def finish(self) -> list[Step]:
        out = [self.held] if self.held is not None else []
        self.held = None
        return out


def request_records(ch: Chunk) -> list[RequestRecord]:
    return records(ch.requests, RequestRecord)
