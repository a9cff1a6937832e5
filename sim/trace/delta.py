"""Delta-encoded page lists of rows.parquet (trace format_version 2 and 3, docs/trace.md).

Every decode row repeats its request's whole page table: ~600M page ids per 10k requests of
workload (a), which Parquet encodes at ~7-9 ns an id. On disk a row therefore keeps only what
changed since an earlier row of the same request:

    full(i) = full(prev_row[i])[:keep[i]] + tail(i)        (prev_row[i] == -1: keep 0, all tail)

for `pages` (keep: `pages_keep`) and `alloc` (`alloc_keep`). `RowEncoder` picks prev_row = the
request's previous row, if it is at most WINDOW rows back; `decode_rows` accepts any earlier row
of the same request and validates every reference first (numba does not bounds-check).
The fast engine's kernel applies the same rule itself when nothing else needs whole lists
(sim/fast/stored.py `page_lists`): both engines store the same table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import numpy as np
import pyarrow as pa

from sim.errors import TraceError
from sim.jit_cache import drop_stale
from sim.trace.schema import DELTA_COLUMNS, RUN_COLUMNS, RUN_LISTS, SCHEMAS

drop_stale(__file__)  # before the kernels below load anything from numba's cache

import numba as nb  # noqa: E402

LISTS = ("pages", "alloc")  # the delta-encoded list columns, with their `<name>_keep`
# How far back a row may refer. It bounds what the encoder carries between batches; a rule on
# the row sequence alone (not on batches) keeps the stored table, and so the digest, the same
# however the engine batched its rows (the fast and reference engines batch differently).
WINDOW = 1 << 16
_I32_MAX = (1 << 31) - 1

ListCol = tuple[np.ndarray, np.ndarray]  # (offsets int64, values int32)


class RowEncoder:
    """Encodes the rows table batch by batch (TraceWriter), each batch's row ordinals following
    the previous batch's. Carries the last row of each request seen in the last WINDOW rows,
    so a row may refer to a row of an earlier batch."""

    def __init__(self) -> None:
        self.rows = 0  # rows encoded so far: the ordinal of the next one
        self.req = np.empty(0, np.int64)  # the carried rows: request, ordinal, full lists
        self.ord = np.empty(0, np.int64)
        self.lists = {n: (np.zeros(1, np.int64), np.empty(0, np.int32)) for n in LISTS}

    def encode(self, cols: Mapping[str, object]) -> dict[str, object]:
        """Logical rows columns (numpy, lists as (offsets, values)) -> the stored ones: `pages`
        and `alloc` become their tails, plus DELTA_COLUMNS."""
        req = np.asarray(cols["request"], np.int64)
        m, n = len(self.req), len(req)
        req_all = np.concatenate([self.req, req])
        ord_all = np.concatenate([self.ord, self.rows + np.arange(n, dtype=np.int64)])
        order = np.argsort(req_all, kind="stable")  # by request; stable: each in row order
        same = req_all[order[1:]] == req_all[order[:-1]]  # order[k + 1] follows order[k]
        prev = _previous(order, same, ord_all)  # index into [carry, batch]; -1: none
        out = dict(cols, prev_row=np.where(prev[m:] >= 0, ord_all[prev[m:]], -1))
        batch = {name: _as_list(cols[name]) for name in LISTS}
        for name in LISTS:
            keep, t_off, t_vals = _encode(prev[m:], m, *self.lists[name], *batch[name])
            out[name], out[f"{name}_keep"] = (t_off, t_vals), keep
        for name in RUN_LISTS:
            start, run, t_off, t_vals = _runs(*_as_list(cols[name]))
            out[name], out[f"{name}_start"], out[f"{name}_run"] = (t_off, t_vals), start, run
        is_last = np.ones(len(order), bool)  # each request's last row
        is_last[:-1] = ~same
        self._carry(np.sort(order[is_last]), req_all, ord_all, batch, self.rows + n)
        return out

    def _carry(self, last: np.ndarray, req_all: np.ndarray, ord_all: np.ndarray,
               batch: dict[str, ListCol], rows: int) -> None:
        """Keep each request's last row, if a row from `rows` on may still refer to it."""
        idx = last[ord_all[last] >= rows - WINDOW]
        m = len(self.req)
        self.lists = {n: _gather(idx, m, *self.lists[n], *batch[n]) for n in LISTS}
        self.req, self.ord, self.rows = req_all[idx], ord_all[idx], rows


def _previous(order: np.ndarray, same: np.ndarray, ordinal: np.ndarray) -> np.ndarray:
    """Index of each row's previous row of the same request, if within WINDOW; else -1."""
    prev = np.full(len(order), -1, np.int64)
    prev[order[1:][same]] = order[:-1][same]
    far = (prev >= 0) & (ordinal - ordinal[np.maximum(prev, 0)] > WINDOW)
    prev[far] = -1
    return prev


def _as_list(v: object) -> ListCol:
    """One dtype and layout for every caller: numba compiles the kernels once (sim.fast.warm)."""
    off, vals = cast(ListCol, v)
    return np.ascontiguousarray(off, np.int64), np.ascontiguousarray(vals, np.int32)


@nb.njit(cache=True)
def _span(p, m, c_off, c_vals, off, vals):  # type: ignore[no-untyped-def]
    """Row p of [carry (m rows), batch]: (values, start, end)."""
    if p < m:
        return c_vals, c_off[p], c_off[p + 1]
    return vals, off[p - m], off[p - m + 1]


@nb.njit(cache=True)
def _common(x, y):  # type: ignore[no-untyped-def]
    """Length of the common prefix of x and y (as long as each other). Usually all of it (a
    decode row's list is its previous row's, plus a page at times): one pass the compiler
    vectorizes settles that, the id-by-id scan runs only when they differ. Slices indexed from
    0, not offsets: numba's negative-index wraparound would stop the vectorizing (2x slower)."""
    d = 0
    for t in range(len(x)):
        d |= x[t] ^ y[t]
    if d == 0:
        return len(x)
    k = 0
    while x[k] == y[k]:
        k += 1
    return k


@nb.njit(cache=True, nogil=True)
def _encode(prev, m, c_off, c_vals, off, vals):  # type: ignore[no-untyped-def]
    """Per batch row: keep = common prefix with row prev[i] of [carry, batch]; the tail after it."""
    n = len(prev)
    keep = np.zeros(n, np.int64)
    t_off = np.zeros(n + 1, np.int64)
    for i in range(n):
        a, b, k = off[i], off[i + 1], 0
        if prev[i] >= 0:
            src, s, e = _span(prev[i], m, c_off, c_vals, off, vals)
            n_both = min(e - s, b - a)
            k = _common(src[s:s + n_both], vals[a:a + n_both])
        keep[i] = k
        t_off[i + 1] = t_off[i] + b - a - k
    t_vals = np.empty(t_off[n], np.int32)
    for i in range(n):
        if t_off[i + 1] > t_off[i]:  # most rows keep all: a slice each would cost more
            t_vals[t_off[i]:t_off[i + 1]] = vals[off[i] + keep[i]:off[i + 1]]
    return keep, t_off, t_vals


@nb.njit(cache=True)
def _gather(idx, m, c_off, c_vals, off, vals):  # type: ignore[no-untyped-def]
    """Rows idx of [carry, batch] as a new list column (the next carry)."""
    g_off = np.zeros(len(idx) + 1, np.int64)
    for j in range(len(idx)):
        _src, s, e = _span(idx[j], m, c_off, c_vals, off, vals)
        g_off[j + 1] = g_off[j] + e - s
    g_vals = np.empty(g_off[-1], np.int32)
    for j in range(len(idx)):
        src, s, e = _span(idx[j], m, c_off, c_vals, off, vals)
        g_vals[g_off[j]:g_off[j + 1]] = src[s:e]
    return g_off, g_vals


@nb.njit(cache=True, nogil=True)
def _runs(off, vals):  # type: ignore[no-untyped-def]
    """Per row: the leading run start, start + 1, ... of its list (start 0 and run 0 for an
    empty list) and the tail after it: (start, run, tail offsets, tail values)."""
    n = len(off) - 1
    start, run = np.zeros(n, np.int64), np.zeros(n, np.int64)
    t_off = np.zeros(n + 1, np.int64)
    for i in range(n):
        a, b = off[i], off[i + 1]
        k = 0
        if b > a:
            start[i] = vals[a]
            k = 1
            while a + k < b and vals[a + k] == vals[a] + k:
                k += 1
        run[i] = k
        t_off[i + 1] = t_off[i] + b - a - k
    t_vals = np.empty(t_off[n], np.int32)
    for i in range(n):
        if t_off[i + 1] > t_off[i]:  # rarely: a slice per row costs more than the runs
            t_vals[t_off[i]:t_off[i + 1]] = vals[off[i] + run[i]:off[i + 1]]
    return start, run, t_off, t_vals


# -- decoding ---------------------------------------------------------------------------------
_BAD = {1: "prev_row {p} is not an earlier row (-1 <= prev_row < row)",
        2: "prev_row {p} is a row of another request",
        3: "{name}_keep {k} is negative",
        4: "{name}_keep {k} with prev_row -1 (nothing to keep: must be 0)",
        5: "{name}_keep {k} is more than the {have} ids of row prev_row {p}"}


@nb.njit(cache=True)
def _decode_offsets(request, prev, keep, t_off):  # type: ignore[no-untyped-def]
    """Offsets of the full lists, validating every reference first: (offsets, -1, 0), or
    (_, row, code of _BAD) at the first bad row."""
    n = len(prev)
    off = np.zeros(n + 1, np.int64)
    for i in range(n):
        p, k = prev[i], keep[i]
        if p < -1 or p >= i:
            return off, i, 1
        if p >= 0 and request[p] != request[i]:
            return off, i, 2
        if k < 0:
            return off, i, 3
        if p == -1 and k:
            return off, i, 4
        if p >= 0 and k > off[p + 1] - off[p]:
            return off, i, 5
        off[i + 1] = off[i] + k + t_off[i + 1] - t_off[i]
    return off, -1, 0


@nb.njit(cache=True, nogil=True)
def _decode_values(prev, keep, t_off, t_vals, off):  # type: ignore[no-untyped-def]
    """One forward pass: row prev[i] < i is already whole when row i copies its prefix."""
    out = np.empty(off[-1], np.int32)
    for i in range(len(prev)):
        s, k = off[i], keep[i]
        if k:
            q = off[prev[i]]
            out[s:s + k] = out[q:q + k]
        if t_off[i + 1] > t_off[i]:
            out[s + k:off[i + 1]] = t_vals[t_off[i]:t_off[i + 1]]
    return out


def decode_rows(stored: pa.Table, where: str) -> pa.Table:
    """rows.parquet as stored (ON_DISK[2 or 3]["rows"]) -> the logical rows table.

    Raises TraceError naming `where`, the row ordinal and the problem for a reference that does
    not resolve, a run that does not fit int32, or if a column's full lists exceed Arrow's
    int32 offsets.
    """
    ints = {c: _ints(stored, c, where) for c in ("request", *DELTA_COLUMNS)}
    full = {n: _decode(ints, n, _stored_list(stored, n, where), where) for n in LISTS}
    if RUN_COLUMNS[0] in stored.column_names:  # format 3
        full |= {n: _decode_runs(stored, n, where) for n in RUN_LISTS}
    return pa.Table.from_arrays([full.get(f.name, stored.column(f.name))
                                 for f in SCHEMAS["rows"]], schema=SCHEMAS["rows"])


def _decode(ints: dict[str, np.ndarray], name: str, tail: ListCol, where: str) -> pa.Array:
    prev, keep = ints["prev_row"], ints[f"{name}_keep"]
    off, row, code = _decode_offsets(ints["request"], prev, keep, tail[0])
    if code:
        p, k = int(prev[row]), int(keep[row])
        have = int(off[p + 1] - off[p]) if 0 <= p < row else 0
        raise TraceError(f"{where}: row {row}: " + _BAD[code].format(p=p, k=k, name=name,
                                                                     have=have))
    if off[-1] > _I32_MAX:
        raise TraceError(f"{where}: {name} holds {int(off[-1])} ids in all, more than one "
                         f"Arrow list column takes ({_I32_MAX}): the trace is too large to "
                         "read into memory")
    vals = _decode_values(prev, keep, tail[0], tail[1], off)
    return pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), pa.array(vals))


_BAD_RUN = {1: "{name}_run {run} is negative",
            2: "{name}_start {start} + {name}_run {run} leaves int32 (positions are int32)",
            3: "{name}_start {start} with {name}_run 0 (nothing to start: must be 0)"}


@nb.njit(cache=True)
def _run_offsets(start, run, t_off):  # type: ignore[no-untyped-def]
    """Offsets of the whole lists, validating every run first: (offsets, -1, 0), or
    (_, row, code of _BAD_RUN) at the first bad row."""
    n = len(run)
    off = np.zeros(n + 1, np.int64)
    for i in range(n):
        if run[i] < 0:
            return off, i, 1
        if run[i] and (start[i] < -_I32_MAX - 1 or start[i] + run[i] - 1 > _I32_MAX):
            return off, i, 2
        if run[i] == 0 and start[i] != 0:
            return off, i, 3
        off[i + 1] = off[i] + run[i] + t_off[i + 1] - t_off[i]
    return off, -1, 0


@nb.njit(cache=True, nogil=True)
def _run_values(start, run, t_off, t_vals, off):  # type: ignore[no-untyped-def]
    out = np.empty(off[-1], np.int32)
    for i in range(len(run)):
        s = off[i]
        for j in range(run[i]):
            out[s + j] = start[i] + j
        if t_off[i + 1] > t_off[i]:
            out[s + run[i]:off[i + 1]] = t_vals[t_off[i]:t_off[i + 1]]
    return out


def _decode_runs(stored: pa.Table, name: str, where: str) -> pa.Array:
    start, run = (_ints(stored, f"{name}_{c}", where) for c in ("start", "run"))
    t_off, t_vals = _stored_list(stored, name, where)
    off, row, code = _run_offsets(start, run, t_off)
    if code:
        raise TraceError(f"{where}: row {row}: " + _BAD_RUN[code].format(
            name=name, start=int(start[row]), run=int(run[row])))
    if off[-1] > _I32_MAX:
        raise TraceError(f"{where}: {name} holds {int(off[-1])} positions in all, more than one "
                         f"Arrow list column takes ({_I32_MAX}): the trace is too large to "
                         "read into memory")
    vals = _run_values(start, run, t_off, t_vals, off)
    return pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), pa.array(vals))


def _ints(t: pa.Table, name: str, where: str) -> np.ndarray:
    col = t.column(name)
    if col.null_count:
        raise TraceError(f"{where}: column {name} has nulls")
    return np.array(col.to_numpy(), np.int64)  # a writable copy: one kernel signature


def _stored_list(t: pa.Table, name: str, where: str) -> ListCol:
    col = t.column(name).combine_chunks()
    if col.null_count or col.values.null_count:
        raise TraceError(f"{where}: column {name} has nulls")
    off = np.array(col.offsets.to_numpy(), np.int64)
    vals = np.array(col.values.to_numpy(), np.int32)
    return off, vals
