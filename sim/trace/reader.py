"""Read a trace directory back (docs/trace.md), refusing anything that is not a whole trace.

`table_digest` recomputes the trace's content digest (sim/trace/digest.py: sha256 per column
for formats 1 and 2, xxh3-128 for format 3) from the tables as stored, to compare with the one
the writer computed while streaming; only then are the delta-encoded page lists of formats 2 and
3, and format 3's position runs, decoded (sim/trace/delta.py). `Trace.tables` are always the
logical tables (SCHEMAS), whichever format_version the directory has.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sim.errors import TraceError
from sim.trace.delta import decode_rows
from sim.trace.digest import TableDigest, combine
from sim.trace.records import (
    READABLE_VERSIONS,
    BlockEvent,
    RowRecord,
    StepRecord,
)
from sim.trace.schema import ON_DISK, RECORDS, TABLES
from sim.trace.validate import (
    check_files,
    check_stored_rows,
    check_tables,
    read_manifest_bytes,
)

_TMP_NAME = re.compile(r"\.tmp-[0-9]+$")  # TraceWriter's DIR.tmp-<pid>
# The checker allocates per KV slot and per block; the same bounds as a scenario's (sim.config).
_MODEL_INTS = {"tokens_per_block": (1, 1024), "num_blocks": (1, 10_000_000)}


@dataclass(frozen=True, slots=True)
class Trace:
    path: Path
    manifest: dict[str, Any]
    tables: dict[str, pa.Table]  # name -> table in its fixed schema


def table_digest(tables: list[pa.Table], version: int) -> str:
    """The digest (hex) of format_version `version` over the tables in TABLES order (steps, rows,
    requests, blocks, violations), as stored: in the schemas ON_DISK[version] (format 1: the
    logical tables; 2 and 3: rows with its delta-encoded page lists), with that version's hash.

    Column names, types and values count; chunking, column order and metadata do not
    (sim/trace/digest.py: the writer computes the same digest as it streams).
    """
    schemas = ON_DISK[version]
    parts = []
    for name, table in zip(TABLES, tables, strict=True):
        d = TableDigest(name, schemas[name], version)
        d.update(_conform(table, schemas[name], name))
        parts.append(d.hexdigest())
    return combine(parts)


def read_trace(path: str | Path, content: bool = True) -> Trace:
    """Read and validate a trace directory. Raises TraceError naming the file and the problem.

    `content`: hold the tables to the trace contract (sim/trace/validate.py); False only for
    the codec's tests, whose traces hold rows alone (files, digest and decoding still checked).
    """
    root = Path(path)
    if _TMP_NAME.search(root.name):
        raise TraceError(f"{root}: a writer's temporary directory (an interrupted run), "
                         "not a trace")
    if not root.is_dir():
        what = "must be a trace directory" if root.exists() else "trace directory does not exist"
        raise TraceError(f"{root}: {what}")
    manifest = _read_manifest(root / "manifest.json")
    version = manifest["format_version"]
    schemas = ON_DISK[version]
    check_files(root, TABLES, manifest.get("counts", {}))  # before reading any data
    tables = {name: _read_table(root / f"{name}.parquet", schemas[name]) for name in TABLES}
    got = table_digest([tables[n] for n in TABLES], version)
    if got != manifest.get("digest"):
        raise TraceError(f"{root}: digest mismatch: manifest.json says {manifest.get('digest')}, "
                         f"the tables hash to {got}")
    if content:
        check_stored_rows(root, tables["rows"], manifest["model"])
    if version >= 2:  # decode only what the digest vouched for
        tables["rows"] = decode_rows(tables["rows"], str(root / "rows.parquet"))
    if content:
        check_tables(root, tables, manifest["model"])  # the digest proves no content right
    return Trace(root, manifest, tables)


def _read_manifest(file: Path) -> dict[str, Any]:
    if not file.exists():
        raise TraceError(f"{file} is missing: not a trace, or one whose writing never finished")
    try:
        manifest = json.loads(read_manifest_bytes(file))
    except (OSError, ValueError, RecursionError) as e:
        raise TraceError(f"{file} is not valid JSON ({e}): a partial write?") from e
    if not isinstance(manifest, dict) or manifest.get("complete") is not True:
        raise TraceError(f"{file} lacks \"complete\": true: the trace was not finished")
    version = manifest.get("format_version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise TraceError(f"{file}: format_version {version!r}, this kvsim reads "
                         f"{' or '.join(map(str, READABLE_VERSIONS))}")
    _check_model(file, manifest.get("model"))
    if not isinstance(manifest.get("counts", {}), dict):
        raise TraceError(f"{file}: \"counts\" must be an object of table -> rows")
    if not isinstance(manifest.get("digest"), str):
        raise TraceError(f"{file}: \"digest\" must be the hex digest string of the tables")
    return manifest


def _check_model(file: Path, model: object) -> None:
    """Refuse a model the checker cannot size, before it allocates anything."""
    from sim.config import MAX_KV_SLOTS

    if not isinstance(model, dict) or not _MODEL_INTS.keys() <= model.keys():
        raise TraceError(f"{file}: \"model\" must give tokens_per_block and num_blocks")
    for key, (lo, hi) in _MODEL_INTS.items():
        v = model[key]
        if type(v) is not int or not lo <= v <= hi:
            raise TraceError(f"{file}: model.{key} must be an int in [{lo}, {hi}], got {v!r}")
    if model["num_blocks"] * model["tokens_per_block"] > MAX_KV_SLOTS:
        raise TraceError(f"{file}: model.num_blocks * model.tokens_per_block must be <= "
                         f"{MAX_KV_SLOTS} KV slots")
    if not isinstance(model.get("null_block", False), bool):
        raise TraceError(f"{file}: model.null_block must be true or false, "
                         f"got {model['null_block']!r}")


def _read_table(file: Path, schema: pa.Schema) -> pa.Table:
    try:
        table = pq.read_table(file)
    except (OSError, pa.ArrowException) as e:
        raise TraceError(f"{file} is unreadable (truncated or corrupt): {e}") from e
    return _conform(table, schema, str(file))


def _conform(table: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    missing = [n for n in schema.names if n not in table.column_names]
    if missing:
        raise TraceError(f"{where} lacks columns {missing}")
    for name in schema.names:  # nulls first: the cast's own message names no row
        col = table.column(name)
        nulls = col.null_count or (pa.types.is_list(col.type)
                                   and sum(c.flatten().null_count for c in col.chunks))
        if nulls:
            raise TraceError(f"{where}: {name}: must have no nulls (got {nulls})")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise TraceError(f"{where}: columns do not fit the format's types: {e}") from e


def records(trace: Trace, name: str) -> list[Any]:
    """The rows of one table as its frozen records (list columns become tuples)."""
    cls, t = RECORDS[name], trace.tables[name]
    cols = [t.column(f).to_pylist() for f in t.column_names]
    for i, f in enumerate(t.schema):
        if pa.types.is_list(f.type):
            cols[i] = [tuple(x) for x in cols[i]]
    return [cls(*vals) for vals in zip(*cols, strict=True)]


def iter_records(trace: Trace) -> Iterator[BlockEvent | tuple[StepRecord, list[RowRecord]]]:
    """Records in checker call order: per step k, its sched events, (step, rows), its proc events.

    Events of a step with no step record (e.g. after the last launch) keep their place by step.
    """
    by_step: dict[int, list[RowRecord]] = {}
    for row in records(trace, "rows"):
        by_step.setdefault(row.step, []).append(row)
    items: list[tuple[tuple[int, int, int], BlockEvent | tuple[StepRecord, list[RowRecord]]]]
    items = [((s.step, 1, 0), (s, sorted(by_step.get(s.step, []), key=lambda r: r.row)))
             for s in records(trace, "steps")]
    items += [((e.step, 0 if e.phase == "sched" else 2, e.seq), e)
              for e in records(trace, "blocks")]
    items.sort(key=lambda kv: kv[0])
    for _key, item in items:
        yield item
