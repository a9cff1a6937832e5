"""Read a trace directory (docs/trace.md) into plain Python records for the replay.

The replay depends on the trace format only, never on the simulator's internals. The tables come
from `sim.trace.reader.read_trace`, which validates the directory (manifest, version, counts,
digest with the version's hash) and decodes the delta-encoded page lists of formats 2 and 3: the
replay sees the logical tables of docs/trace.md whichever format_version the trace has (reading
rows.parquet here with pyarrow would hand back the stored page-list tails, not the page lists).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_backend.host.batch import LISTS, SCALARS, Columns, bad_lengths
from sim.errors import TraceError
from sim.trace.reader import read_trace
from sim.trace.records import READABLE_VERSIONS, BlockEvent, RowRecord, StepRecord
from sim.trace.validate import read_manifest_bytes

MODEL_KEYS = ("num_q_heads", "num_kv_heads", "head_dim", "tokens_per_block", "num_blocks", "dtype")


@dataclass(frozen=True)
class ModelShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_blocks: int
    dtype: str
    # rows of the engine's RoPE table (manifest model.max_position_embeddings; None: unbounded)
    max_position: int | None = None


@dataclass
class TraceData:
    path: Path
    manifest: dict[str, Any]
    model: ModelShape
    steps: list[StepRecord]
    rows: dict[int, list[RowRecord]]  # step -> rows in batch order
    prompts: dict[int, tuple[int, ...]]  # request -> prompt + committed output tokens
    events: dict[tuple[int, str], list[BlockEvent]] = field(default_factory=dict)
    violations: list[tuple[str, int, int, str]] = field(default_factory=list)
    # step -> its rows as arrays, in row order (`layout.columns`: what `layout.build_step`
    # reads), from the decoded Arrow columns: views where the step's rows are contiguous
    columns: dict[int, Columns] = field(default_factory=dict)
    # (step, phase) -> its block events as arrays in seq order (`EventColumns`), from the
    # decoded Arrow table: what `events.event_ops` reads
    event_columns: dict[tuple[int, str], EventColumns] = field(default_factory=dict)
    # steps whose `columns` hold their rows with consistent lengths (`layout.build_step`'s
    # checks, made once for the trace here: ~20 µs a step there, at batch 64)
    checked: frozenset[int] = frozenset()


EVENT_CODES = ("alloc", "reuse", "copy", "free", "evict", "rewind", "hash", "done")


@dataclass(frozen=True)
class EventColumns:
    """One (step, phase)'s block events, seq order; `code` indexes EVENT_CODES."""
    code: np.ndarray
    block: np.ndarray
    refcount: np.ndarray
    seq: np.ndarray
    src: np.ndarray
    num_tokens: np.ndarray


def _manifest(path: Path) -> dict[str, Any]:
    f = path / "manifest.json"
    if not path.is_dir():
        raise TraceError(f"{path}: not a trace directory")
    if not f.exists():
        raise TraceError(f"{path}: manifest.json is missing (not a complete trace)")
    try:  # a FIFO or an oversize file is refused before it is opened
        m = json.loads(read_manifest_bytes(f))
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{f}: not valid JSON ({e})") from None
    if not isinstance(m, dict):
        raise TraceError(f"{f}: must be a JSON object (got {type(m).__name__})")
    version = m.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise TraceError(f"{f}: format_version {version!r}, "
                         f"this replay reads {' or '.join(map(str, READABLE_VERSIONS))}")
    if m.get("complete") is not True:
        raise TraceError(f"{f}: trace is not marked complete")
    missing = [k for k in MODEL_KEYS if k not in m.get("model", {})]
    if missing:
        raise TraceError(f"{f}: model is missing {', '.join(missing)}")
    return dict(m)


def _tables(path: Path) -> tuple[dict[str, list[dict[str, Any]]], pa.Table, pa.Table]:
    """All five logical tables as lists of dicts, and the rows and blocks tables themselves."""
    t = read_trace(path)
    return {n: t.tables[n].to_pylist() for n in ("steps", "rows", "requests", "blocks",
                                                    "violations")}, t.tables["rows"], \
        t.tables["blocks"]


def _event_columns(table: pa.Table, path: Path) -> dict[tuple[int, str], EventColumns]:
    """`TraceData.event_columns`: the blocks table sorted by seq, cut at each (step, phase)."""
    if table.num_rows == 0:
        return {}
    col = {k: _ints(table.column(k)) for k in ("step", "seq", "block", "refcount", "src",
                                               "num_tokens")}
    code = _codes(table.column("event"), EVENT_CODES, path, "event")
    proc = _codes(table.column("phase"), ("sched", "proc"), path, "phase")
    order = np.lexsort((col["seq"], proc, col["step"]))
    step, proc, code = col["step"][order], proc[order], code[order]
    cut = np.flatnonzero((np.diff(step) != 0) | (np.diff(proc) != 0)) + 1
    starts, ends = [0, *cut.tolist()], [*cut.tolist(), len(order)]
    cols = {k: col[k][order] for k in ("block", "refcount", "seq", "src", "num_tokens")}
    return {(int(step[a]), "proc" if proc[a] else "sched"): EventColumns(
        code[a:z], **{k: v[a:z] for k, v in cols.items()}) for a, z in zip(starts, ends,
                                                                             strict=True)}


def _codes(a: pa.ChunkedArray, names: tuple[str, ...], path: Path, what: str) -> np.ndarray:
    """a's strings as their index in names; TraceError naming one that is not there."""
    if pa.types.is_dictionary(a.type):
        a = a.cast(a.type.value_type)
    idx = pc.index_in(a, value_set=pa.array(names))
    if idx.null_count:
        bad = a.filter(pc.is_null(idx))[0].as_py()
        raise TraceError(f"{path}: blocks.parquet has {what} {bad!r}, not one of "
                         f"{', '.join(names)}")
    return _ints(idx)


def _columns(table: pa.Table, order: dict[int, list[int]]) -> dict[int, Columns]:
    """`TraceData.columns`; order: step -> its rows' table indices in row order. Walking the
    rows' tuples instead (`layout.columns`) took ~1.2 of a 2.3 ms step's preparation at batch
    64 x kv 8k, ~0.4 of a 1.07 ms step's at 64 x 2k (this project's CPU)."""
    flat: dict[str, np.ndarray] = {k: _ints(table.column(k)) for k in SCALARS}
    phase = table.column("phase")
    flat["is_ctx"] = pc.equal(phase, "ctx").to_numpy(zero_copy_only=False)
    flat["is_gen"] = pc.equal(phase, "gen").to_numpy(zero_copy_only=False)
    offs: dict[str, np.ndarray] = {}
    for k in LISTS:
        col = table.column(k)
        flat[k] = _ints(pc.list_flatten(col))
        flat[k + "_len"] = _ints(pc.list_value_length(col))
        offs[k] = np.concatenate([[0], np.cumsum(flat[k + "_len"])])
    out: dict[int, Columns] = {}
    for step, idx in order.items():
        lo, hi = (idx[0], idx[-1] + 1) if idx else (0, 0)
        if idx == list(range(lo, hi)):
            c = {k: v[lo:hi] for k, v in flat.items() if k not in offs}
            c |= {k: flat[k][o[lo]: o[hi]] for k, o in offs.items()}
        else:
            c = {k: v[idx] for k, v in flat.items() if k not in offs}
            c |= {k: np.concatenate([flat[k][o[i]: o[i + 1]] for i in idx] or [flat[k][:0]])
                  for k, o in offs.items()}
        out[step] = c
    return out


def _checked(table: pa.Table, order: dict[int, list[int]]) -> frozenset[int]:
    """`TraceData.checked`: the steps none of whose rows `layout._check_lengths` refuses (their
    columns are cut from the same table as their rows, so they fit them)."""
    bad = bad_lengths(_ints(table.column("q_len")),
                      *(_ints(pc.list_value_length(table.column(k)))
                        for k in ("rope_pos", "append_pos", "tokens")))
    return frozenset(s for s, idx in order.items() if not bad[idx].any())


def _ints(a: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(a.to_numpy(zero_copy_only=False), dtype=np.int64)


def _as_row(d: dict[str, Any]) -> RowRecord:
    vals: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()
                            if k in RowRecord.__dataclass_fields__}
    return RowRecord(**vals)


def _as_step(d: dict[str, Any]) -> StepRecord:
    return StepRecord(**{k: v for k, v in d.items() if k in StepRecord.__dataclass_fields__})


def load_trace(path: str | Path) -> TraceData:
    """Read TRACE_DIR. Raises TraceError for anything missing, partial or of another version."""
    path = Path(path)
    m = _manifest(path)
    tabs, row_table, block_table = _tables(path)
    mm = m["model"]
    model = ModelShape(int(mm["num_q_heads"]), int(mm["num_kv_heads"]), int(mm["head_dim"]),
                       int(mm["tokens_per_block"]), int(mm["num_blocks"]), str(mm["dtype"]),
                       int(mm["max_position_embeddings"]) if "max_position_embeddings" in mm
                       else None)
    if model.num_q_heads % model.num_kv_heads:
        raise TraceError(f"{path}: num_q_heads {model.num_q_heads} is not a multiple of "
                         f"num_kv_heads {model.num_kv_heads}")
    steps = sorted((_as_step(d) for d in tabs["steps"]), key=lambda s: s.step)
    at: dict[int, list[tuple[RowRecord, int]]] = {s.step: [] for s in steps}  # (row, index)
    for i, d in enumerate(tabs["rows"]):
        r = _as_row(d)
        if r.step not in at:
            raise TraceError(f"{path}: rows.parquet has step {r.step}, absent from steps.parquet")
        at[r.step].append((r, i))
    for lst in at.values():
        lst.sort(key=lambda ri: ri[0].row)
    rows = {s: [r for r, _ in lst] for s, lst in at.items()}
    order = {s: [i for _, i in lst] for s, lst in at.items()}
    columns = _columns(row_table, order)
    prompts = {int(d["request"]): tuple(d["prompt_tokens"]) + tuple(d["output_tokens"])
               for d in tabs["requests"]}
    events: dict[tuple[int, str], list[BlockEvent]] = {}
    for d in sorted(tabs["blocks"], key=lambda d: d["seq"]):
        ev = BlockEvent(**{k: v for k, v in d.items() if k in BlockEvent.__dataclass_fields__})
        events.setdefault((ev.step, ev.phase), []).append(ev)
    viols = [(d["invariant"], d["step"], d["request"], d["message"])
             for d in tabs["violations"]]
    return TraceData(path, m, model, steps, rows, prompts, events, viols, columns,
                     _event_columns(block_table, path), _checked(row_table, order))
