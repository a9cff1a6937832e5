"""A trace's content checked on read, beyond its digest (docs/trace.md, 'Validation on read').

The digest only proves the tables are the ones the manifest names; anyone can recompute it.
So before the checker, metrics or timeline trust a trace, `check_tables` holds its logical
tables to the contract: enums known, ids unique and in range, references resolved (rows ->
steps and requests, events and violations -> requests), counts and times in range and steps in
launch order. `check_files` refuses, before anything is read, a file that is not a regular file
and a table with more rows than the manifest says or than a reader can hold. Vectorised: each
rule is a pass of numpy or Arrow over one column. Raises TraceError naming file, column, row.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from sim.errors import TraceError
from sim.inputs import check_kind, read_input

# Rows per table a reader takes: the reader holds whole tables in memory (~200 B a row before
# lists), and a small Parquet file of repeated values can decode to any number of rows.
MAX_ROWS = 1 << 24
MAX_MANIFEST_BYTES = 64 << 20  # the manifest holds the scenario, inline requests included
MAX_ID = (1 << 31) - 1  # step and request ids, counts and lengths (positions are int32)
MAX_POSITIONS = 10_000_000  # a scenario's model.max_position_embeddings bound (sim.config)
MAX_NS = 1 << 62  # timestamps: a later arrival plus a duration must not overflow int64

ENUMS = {("steps", "backend"): ("fa2", "fa3", "xqa"),
         ("rows", "phase"): ("ctx", "gen"),
         ("requests", "finish_reason"): ("length", "max_seq_len", "rejected", "unfinished"),
         ("blocks", "phase"): ("sched", "proc"),
         ("blocks", "event"): ("alloc", "reuse", "copy", "free", "evict", "rewind", "hash",
                               "done")}
_INVARIANT = re.compile(r"(I[0-9]{1,2}|POOL|LIVENESS|HOST)")  # sim/check/registry.py's names

# (table, column) -> (lo, hi) for integer columns; hi None: MAX_ID. Counts >= 0, ids >= 0,
# "none" sentinels -1 (docs/trace.md). Timestamps in [0, MAX_NS] (-1: never happened).
_TIME = (0, MAX_NS)
_RANGES: dict[str, dict[str, tuple[int, int | None]]] = {
    "steps": {"step": (0, None), "t_sched_ns": _TIME, "t_launch_ns": _TIME,
              "t_dev_start_ns": _TIME, "t_dev_end_ns": _TIME, "num_rows": (0, None),
              "num_ctx": (0, None), "num_gen": (0, None), "num_tokens": (0, None),
              "plan_q_len": (-1, None), "plan_batch": (0, None), "plan_cache_size": (0, None),
              "blocks_used": (0, None), "blocks_free": (0, None), "blocks_cached": (0, None),
              "graph_width": (0, None), "processed_step": (-1, None)},
    "rows": {"step": (0, None), "row": (0, None), "request": (0, None), "q_len": (0, None),
             "draft_len": (0, None), "kv_indptr": (0, None), "last_page_len": (0, None),
             "kv_len": (0, None), "cached_host": (-MAX_ID, None),
             "kv_len_host": (-MAX_ID, None), "committed": (0, None), "reserved": (0, None),
             "shared_blocks": (0, None), "accepted": (-1, None), "new_tokens": (0, None),
             "prev_new_tokens": (-1, None), "max_pos": (0, None)},
    "requests": {"request": (0, None), "arrival_ns": _TIME, "prompt_len": (0, None),
                 "output_len": (0, None), "reused_tokens": (0, None),
                 "first_token_ns": (-1, MAX_NS), "finish_ns": (-1, MAX_NS),
                 "num_preemptions": (0, None), "num_steps": (0, None),
                 "accepted_drafts": (0, None), "proposed_drafts": (0, None)},
    "blocks": {"step": (0, None), "seq": (0, None), "block": (-1, None),
               "request": (-1, None), "refcount": (0, None), "src": (-1, None),
               "num_tokens": (0, None)},
    "violations": {"step": (-1, None), "request": (-1, None)},
}


_LENGTHS = ("q_len", "draft_len", "last_page_len", "kv_len", "cached_host", "kv_len_host",
            "committed", "reserved", "shared_blocks", "accepted", "new_tokens",
            "prev_new_tokens", "max_pos")


def regular_file(file: Path) -> os.stat_result:
    """Refuse what is not a regular file (a FIFO or device would block or never end)."""
    try:
        st = os.stat(file)
    except OSError as e:
        raise TraceError(f"{file} is missing ({e.strerror})") from e
    check_kind(file, "trace table", st, TraceError)
    return st


def read_manifest_bytes(file: Path) -> bytes:
    """manifest.json's bytes, refusing a non-regular or oversize file before reading it."""
    return read_input(file, "manifest", MAX_MANIFEST_BYTES, TraceError)


def check_files(root: Path, names: tuple[str, ...], counts: dict) -> None:
    """Each table's file is a regular file whose row count (from the Parquet footer, before any
    data is read) is within MAX_ROWS and what the manifest's `counts` say."""
    for name in names:
        file = root / f"{name}.parquet"
        regular_file(file)
        try:
            rows = pq.read_metadata(file).num_rows
        except (OSError, pa.ArrowException) as e:
            raise TraceError(f"{file} is unreadable (truncated or corrupt): {e}") from e
        if rows > MAX_ROWS:
            raise TraceError(f"{file}: rows: at most {MAX_ROWS} a table (got {rows})")
        want = counts.get(name)
        if want is not None and want != rows:
            raise TraceError(f"{file}: counts.{name}: the manifest says {want!r} rows "
                             f"(got {rows})")


def check_tables(root: Path, tables: dict[str, pa.Table], model: dict) -> None:
    """The logical tables (SCHEMAS) of the trace at `root` against the contract."""
    def where(name: str) -> str:
        return str(root / f"{name}.parquet")

    for name, cols in _RANGES.items():
        for col, (lo, hi) in cols.items():
            _in_range(where(name), tables[name], col, lo, MAX_ID if hi is None else hi)
    for (name, col), allowed in ENUMS.items():
        _enum(where(name), tables[name], col, allowed)
    _invariants(where("violations"), tables["violations"])
    _order_and_references(where, tables)
    _within_model(where, tables, model)


def _order_and_references(where: Callable[[str], str], tables: dict[str, pa.Table]) -> None:
    steps, rows = _ints(tables["steps"], "step"), tables["rows"]
    _increasing(where("steps"), tables["steps"], "step", strict=True)
    _increasing(where("steps"), tables["steps"], "t_launch_ns", strict=False)
    requests = _ints(tables["requests"], "request")
    _unique(where("requests"), requests, "request")
    _refers(where("rows"), rows, "step", steps, "steps.parquet")
    _increasing(where("rows"), rows, "step", strict=False)
    _unique(where("rows"), _ints(rows, "step") * (MAX_ID + 1) + _ints(rows, "request"),
            "(step, request)")
    for name in ("rows", "blocks", "violations"):
        _refers(where(name), tables[name], "request", np.sort(requests), "requests.parquet")
    _increasing(where("blocks"), tables["blocks"], "seq", strict=True)


def _within_model(where: Callable[[str], str], tables: dict[str, pa.Table],
                  model: dict) -> None:
    nb, tpb = model["num_blocks"], model["tokens_per_block"]
    # a row's lengths and positions: the checker walks them slot by slot, so they stay within
    # what the model could ever reach: the pool's slots twice over (a faulty engine's host
    # estimates overshoot, never by a pool) plus the model's positions
    mpe = model.get("max_position_embeddings")
    slots = 2 * nb * tpb + (min(mpe, MAX_POSITIONS) if type(mpe) is int and mpe > 0 else 0)
    rows = tables["rows"]
    for col in _LENGTHS:
        _in_range(where("rows"), rows, col, _RANGES["rows"][col][0], slots)
    for col in ("append_pos", "rope_pos"):
        _list_in_range(where("rows"), rows, col, 0, slots)
    _in_range(where("blocks"), tables["blocks"], "block", -1, nb - 1)
    _in_range(where("blocks"), tables["blocks"], "num_tokens", 0, tpb)
    for name, col in (("rows", "tokens"), ("requests", "prompt_tokens"),
                      ("requests", "output_tokens")):
        _list_in_range(where(name), tables[name], col, 0, MAX_ID)


def check_stored_rows(root: Path, stored: pa.Table, model: dict) -> None:
    """Block ids of rows.parquet's `alloc` as stored, before decoding: a decoded list only
    copies ids of stored ones (sim/trace/delta.py), and the stored ones are ~1/100 of them."""
    _list_in_range(str(root / "rows.parquet"), stored, "alloc", 0, model["num_blocks"] - 1)


def _ints(t: pa.Table, col: str) -> np.ndarray:
    return np.asarray(t.column(col).to_numpy(), np.int64)


def _bad(file: str, col: str, allowed: str, got: object, row: int) -> TraceError:
    return TraceError(f"{file}: {col}: {allowed} (got {got!r} at row {row})")


def _in_range(file: str, t: pa.Table, col: str, lo: int, hi: int) -> None:
    if not t.num_rows:
        return
    v = t.column(col)
    mm = pc.min_max(v).as_py()
    if mm["min"] < lo or mm["max"] > hi:
        a = _ints(t, col)
        i = int(np.argmax((a < lo) | (a > hi)))
        raise _bad(file, col, f"must be in [{lo}, {hi}]", int(a[i]), i)


def _list_in_range(file: str, t: pa.Table, col: str, lo: int, hi: int) -> None:
    first = 0  # row number of the chunk's first row
    for lists in t.column(col).chunks:
        values = lists.flatten()  # a view, chunk by chunk: token lists are large
        mm = pc.min_max(values).as_py()
        if len(values) and (mm["min"] < lo or mm["max"] > hi):
            a = np.asarray(values.to_numpy(), np.int64)
            k = int(np.argmax((a < lo) | (a > hi)))
            row = first + int(np.asarray(pc.list_parent_indices(lists).to_numpy())[k])
            raise _bad(file, col, f"ids must be in [{lo}, {hi}]", int(a[k]), row)
        first += len(lists)


def _enum(file: str, t: pa.Table, col: str, allowed: tuple[str, ...]) -> None:
    ok = pc.is_in(t.column(col), value_set=pa.array(allowed))
    if not pc.all(ok).as_py() and t.num_rows:
        i = pc.index(ok, False).as_py()
        raise _bad(file, col, f"must be one of {', '.join(allowed)}", t.column(col)[i].as_py(), i)


def _invariants(file: str, t: pa.Table) -> None:
    for i, name in enumerate(t.column("invariant").to_pylist()):  # a few rows at most
        if not _INVARIANT.fullmatch(name):
            raise _bad(file, "invariant", "must name an invariant (I1.., POOL, LIVENESS, HOST)",
                       name, i)


def _increasing(file: str, t: pa.Table, col: str, strict: bool) -> None:
    a = _ints(t, col)
    step = np.diff(a)
    bad = step <= 0 if strict else step < 0
    if bad.any():
        i = int(np.argmax(bad)) + 1
        order = "strictly increasing" if strict else "non-decreasing"
        raise _bad(file, col, f"must be {order} from row to row", int(a[i]), i)


def _unique(file: str, keys: np.ndarray, what: str) -> None:
    order = np.argsort(keys, kind="stable")
    dup = keys[order[1:]] == keys[order[:-1]]
    if dup.any():
        i = int(order[1:][np.argmax(dup)])
        raise TraceError(f"{file}: {what}: must be unique (got a repeat at row {i})")


def _refers(file: str, t: pa.Table, col: str, ids: np.ndarray, target: str) -> None:
    """Every value of `col` is one of `ids` (the other table's sorted unique ids) or -1."""
    a = _ints(t, col)
    ok = (a == -1) | _member(a, ids)
    if not ok.all():
        i = int(np.argmax(~ok))
        raise _bad(file, col, f"must name a row of {target}", int(a[i]), i)


def _member(a: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """a in ids (sorted, unique): by a table of flags where ids are dense (steps and requests
    are numbered 0..n-1: one gather a value), else by binary search."""
    if not len(ids):
        return np.zeros(len(a), bool)
    lo, hi = int(ids[0]), int(ids[-1])
    if hi - lo < 4 * len(ids) + 1024:
        flags = np.zeros(hi - lo + 2, bool)  # the last flag stays False: any value out of range
        flags[ids - lo] = True
        return flags[np.clip(a - lo, -1, hi - lo + 1)]
    k = np.minimum(np.searchsorted(ids, a), len(ids) - 1)
    return ids[k] == a
