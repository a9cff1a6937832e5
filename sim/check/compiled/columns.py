"""Trace columns -> the kernels' input: contiguous int arrays, strings as int codes.

Two sources give the same three tables: a fast-engine chunk (numpy columns, list columns as
(offsets, values), strings as object arrays; sim/fast/columns.py `chunk_of`) and a trace on disk
(Arrow tables). Everything here is vectorized; nothing loops over rows in Python.

A list column keeps its values buffer as is (zero-copy from Arrow) with int64 offsets that
index it absolutely, so row r's list is values[off[r]:off[r + 1]] for either source.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sim.check.compiled import codes as cd


class Steps(NamedTuple):
    step: np.ndarray
    backend: np.ndarray
    plan_q_len: np.ndarray
    plan_batch: np.ndarray
    plan_cache_size: np.ndarray
    blocks_used: np.ndarray
    blocks_free: np.ndarray
    graph_width: np.ndarray


class Rows(NamedTuple):
    step: np.ndarray
    row: np.ndarray
    request: np.ndarray
    phase: np.ndarray
    q_len: np.ndarray
    first_gen: np.ndarray
    prev_in_flight: np.ndarray
    kv_indptr: np.ndarray
    last_page_len: np.ndarray
    kv_len: np.ndarray
    cached_host: np.ndarray
    kv_len_host: np.ndarray
    committed: np.ndarray
    reserved: np.ndarray
    shared_blocks: np.ndarray
    accepted: np.ndarray
    prev_new_tokens: np.ndarray
    max_pos: np.ndarray
    pages_off: np.ndarray
    pages: np.ndarray  # int32 (the format's list<int32>)
    app_off: np.ndarray
    app: np.ndarray  # int64: small, normalized so one compiled variant serves both sources
    rope_off: np.ndarray
    rope: np.ndarray
    alloc_off: np.ndarray
    alloc: np.ndarray  # int32
    tok_off: np.ndarray  # only the lengths of `tokens` matter (a row's reach)


class Events(NamedTuple):
    step: np.ndarray
    rank: np.ndarray  # merge rank: SCHED_RANK or PROC_RANK
    seq: np.ndarray
    event: np.ndarray
    block: np.ndarray
    request: np.ndarray
    refcount: np.ndarray
    src: np.ndarray
    num_tokens: np.ndarray


_LISTS = {"pages": ("pages_off", "pages", np.int32), "append_pos": ("app_off", "app", np.int64),
          "rope_pos": ("rope_off", "rope", np.int64), "alloc": ("alloc_off", "alloc", np.int32)}
_STRINGS = {"backend": cd.BACKENDS, "phase": cd.ROW_PHASES, "event": cd.EVENTS}


def _codes(col: Any, names: tuple[str, ...]) -> np.ndarray:
    """Index of each string in `names`, len(names) for any other (one C pass via Arrow)."""
    arr = col if isinstance(col, pa.Array | pa.ChunkedArray) else pa.array(col, pa.string())
    idx = pc.index_in(arr, value_set=pa.array(names, pa.string())).fill_null(len(names))
    return np.ascontiguousarray(idx.to_numpy(), np.int64)


def _ints(col: Any) -> np.ndarray:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(col, pa.Array):
        col = col.to_numpy(zero_copy_only=False)
    return np.ascontiguousarray(col, np.int64)


def _list(col: Any, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(col, pa.Array):
        off, vals = col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False)
    else:
        off, vals = col
    return np.ascontiguousarray(off, np.int64), np.ascontiguousarray(vals, dtype)


def steps_of(cols: Mapping[str, Any]) -> Steps:
    return Steps(**{f: (_codes(cols[f], cd.BACKENDS) if f == "backend" else _ints(cols[f]))
                    for f in Steps._fields})


def events_of(cols: Mapping[str, Any]) -> Events:
    n = len(cols["step"])
    rank = np.where(_codes(cols["phase"], cd.EV_PHASES) == 0, cd.SCHED_RANK, cd.PROC_RANK)
    ev = Events(_ints(cols["step"]), rank.astype(np.int64), _ints(cols["seq"]),
                _codes(cols["event"], cd.EVENTS), _ints(cols["block"]), _ints(cols["request"]),
                _ints(cols["refcount"]), _ints(cols["src"]), _ints(cols["num_tokens"]))
    assert all(len(a) == n for a in ev)
    return sort_events(ev)


def rows_of(cols: Mapping[str, Any]) -> Rows:
    if not cols:
        return empty_rows()
    out: dict[str, np.ndarray] = {}
    for name, (off, vals, dtype) in _LISTS.items():
        out[off], out[vals] = _list(cols[name], dtype)
    out["tok_off"] = _list(cols["tokens"], np.int32)[0]
    for f in Rows._fields:
        if f not in out:
            out[f] = _codes(cols[f], cd.ROW_PHASES) if f == "phase" else _ints(cols[f])
    return sort_rows(Rows(**out))


def empty_rows() -> Rows:
    z, o = np.zeros(0, np.int64), np.zeros(1, np.int64)
    lists = {"pages": np.zeros(0, np.int32), "alloc": np.zeros(0, np.int32)}
    return Rows(**{f: (o if f.endswith("_off") else lists.get(f, z)) for f in Rows._fields})


# -- order -------------------------------------------------------------------------------------
def sort_events(ev: Events) -> Events:
    """Events in (step, rank, seq) order, the order the checker applies them."""
    key = (ev.step, ev.rank, ev.seq)
    if _sorted(*key):
        return ev
    return Events(*(a[np.lexsort(key[::-1])] for a in ev))


def sort_rows(rows: Rows) -> Rows:
    """Rows by (step, row): iter_records hands a step's rows sorted by `row`."""
    if _sorted(rows.step, rows.row):
        return rows
    return take_rows(rows, np.lexsort((rows.row, rows.step)))


def _sorted(*keys: np.ndarray) -> bool:
    """Keys lexicographically nondecreasing (stable: equal keys keep their order)."""
    if len(keys[0]) < 2:
        return True
    later = np.zeros(len(keys[0]) - 1, bool)  # decided: strictly greater than the previous
    for k in keys:
        d = np.diff(k)
        if np.any((d < 0) & ~later):
            return False
        later |= d > 0
    return True


def take_rows(rows: Rows, idx: np.ndarray) -> Rows:
    """Rows `idx` (any order), list columns gathered into fresh compact buffers."""
    out = {f: getattr(rows, f)[idx] for f in Rows._fields
           if not f.endswith("_off") and f not in ("pages", "app", "rope", "alloc")}
    for off, vals in (("pages_off", "pages"), ("app_off", "app"), ("rope_off", "rope"),
                      ("alloc_off", "alloc")):
        out[off], out[vals] = _gather(getattr(rows, off), getattr(rows, vals), idx)
    lens = np.diff(rows.tok_off)[idx]
    out["tok_off"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return Rows(**out)


def _gather(off: np.ndarray, vals: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lens = (off[1:] - off[:-1])[idx]
    new_off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    src = np.repeat(off[:-1][idx] - new_off[:-1], lens) + np.arange(new_off[-1])
    return new_off, vals[src]


def concat_rows(a: Rows, b: Rows) -> Rows:
    both = _cat_lists(a, b)
    return Rows(**{f: both.get(f, np.concatenate([getattr(a, f), getattr(b, f)]))
                   for f in Rows._fields})


def _cat_lists(a: Rows, b: Rows) -> dict[str, np.ndarray]:
    out = {}
    for off, vals in (("pages_off", "pages"), ("app_off", "app"), ("rope_off", "rope"),
                      ("alloc_off", "alloc")):
        oa, ob = getattr(a, off), getattr(b, off)
        va, vb = getattr(a, vals), getattr(b, vals)
        va, vb = va[oa[0]:oa[-1]], vb[ob[0]:ob[-1]]
        out[off] = np.concatenate([oa - oa[0], ob[1:] - ob[0] + len(va)])
        out[vals] = np.concatenate([va, vb])
    ta, tb = a.tok_off, b.tok_off
    out["tok_off"] = np.concatenate([ta - ta[0], tb[1:] - tb[0] + (ta[-1] - ta[0])])
    return out


def view_rows(rows: Rows, lo: int, hi: int) -> Rows:
    """Rows [lo, hi) without copying: offsets still index the same values buffers."""
    return Rows(**{f: (a if f in _VALUES else a[lo:hi + 1] if f.endswith("_off") else a[lo:hi])
                   for f, a in zip(Rows._fields, rows, strict=True)})


_VALUES = ("pages", "app", "rope", "alloc")


def slice_rows(rows: Rows, lo: int, hi: int) -> Rows:
    """Rows [lo, hi), every array copied (a held-back tail outlives its chunk's buffers)."""
    return take_rows(rows, np.arange(lo, hi))
