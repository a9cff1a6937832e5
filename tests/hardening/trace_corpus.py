"""Corrupted kvsim traces whose digest was recomputed: only validation on read can refuse them.

Each mutation rewrites one table of a copy of a valid trace as stored, then writes the
manifest's `counts` and `digest` for what is now on disk (as anyone with kvsim's digest code
can), so the digest check passes and sim/trace/validate.py must find the problem. Generated
from the validator's own rules where it can (every bounded integer column just past each
bound, every enum column), plus references, uniqueness, order, nulls, ids in lists, sizes and
files that are not regular files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sim.errors import TraceError
from sim.trace.reader import table_digest
from sim.trace.schema import TABLES
from sim.trace.validate import (
    _LENGTHS,
    _RANGES,
    ENUMS,
    MAX_ID,
    MAX_MANIFEST_BYTES,
    MAX_ROWS,
)

Mutator = Callable[[Path], None]
Edit = Callable[[pa.Table], pa.Table]
# a violation row to mutate: the valid trace has none
VIOLATION = {"invariant": "I17", "step": 0, "request": 0, "message": "freed twice"}


def _stored(d: Path) -> dict[str, pa.Table]:
    return {n: pq.read_table(d / f"{n}.parquet") for n in TABLES}


def _publish(d: Path, tables: dict[str, pa.Table]) -> None:
    """Rewrite the manifest's counts and digest for the tables as now stored."""
    m = json.loads((d / "manifest.json").read_text())
    m["counts"] = {n: tables[n].num_rows for n in TABLES}
    try:
        m["digest"] = table_digest([tables[n] for n in TABLES], m["format_version"])
    except TraceError:  # e.g. nulls: the reader refuses them before it hashes anything
        pass
    (d / "manifest.json").write_text(json.dumps(m))


def rewrite(table: str, edit: Edit) -> Mutator:
    def go(d: Path) -> None:
        tables = _stored(d)
        if table == "violations" and not tables[table].num_rows:
            tables[table] = pa.Table.from_pylist([VIOLATION], schema=tables[table].schema)
        tables[table] = edit(tables[table])
        pq.write_table(tables[table], d / f"{table}.parquet")
        _publish(d, tables)
    return go


def column(col: str, fn: Callable[[list], list]) -> Edit:
    """Replace column `col` by fn(its values as a list); the type stays unless values force it."""
    def edit(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index(col)
        f = t.schema.field(i)
        values = fn(t.column(col).to_pylist())
        arr = pa.array(values, f.type) if None not in values else pa.array(values)
        field = pa.field(col, arr.type, nullable=None in values or arr.null_count > 0)
        return t.set_column(i, field, arr)
    return edit


def every(value: Any) -> Callable[[list], list]:
    return lambda vals: [value] * len(vals)


def at(row: int, value: Any) -> Callable[[list], list]:
    def fn(vals: list) -> list:
        vals = list(vals)
        vals[row] = value
        return vals
    return fn


def append_copy(row: int, **changes: Any) -> Edit:
    def edit(t: pa.Table) -> pa.Table:
        rec = dict(t.slice(row, 1).to_pylist()[0], **changes)
        return pa.concat_tables([t, pa.Table.from_pylist([rec], schema=t.schema)])
    return edit


def drop_row(row: int) -> Edit:
    return lambda t: pa.concat_tables([t.slice(0, row), t.slice(row + 1)])


def _name(table: str) -> str:
    return f"{table}.parquet"


def range_mutations() -> Iterator[tuple[str, Mutator, str, str]]:
    """(name, mutation, file, column): every bounded integer column just past each bound."""
    for table, cols in _RANGES.items():
        for col, (lo, hi) in cols.items():
            for bad in (lo - 1, (MAX_ID if hi is None else hi) + 1):
                yield f"range:{table}.{col}={bad}", rewrite(table, column(col, every(bad))), \
                    _name(table), col


def enum_mutations() -> Iterator[tuple[str, Mutator, str, str]]:
    for (table, col), allowed in ENUMS.items():
        for bad in ("bogus", "", allowed[0].upper(), allowed[0] + " "):
            yield f"enum:{table}.{col}={bad!r}", rewrite(table, column(col, at(0, bad))), \
                _name(table), col
    for bad in ("I99x", "", "i1", "POOL; rm"):
        yield f"enum:violations.invariant={bad!r}", \
            rewrite("violations", column("invariant", at(0, bad))), _name("violations"), \
            "invariant"


def reference_mutations() -> Iterator[tuple[str, Mutator, str, str]]:
    """Rows, events and violations naming requests or steps that do not exist; repeats."""
    yield "ref:rows.request-unknown", rewrite("rows", column("request", every(7777))), \
        _name("rows"), "request"
    yield "ref:rows.request-2^40", rewrite("rows", column("request", every(1 << 40))), \
        _name("rows"), "request"
    yield "ref:requests-dropped", rewrite("requests", drop_row(1)), _name("rows"), "request"
    yield "ref:requests-empty", rewrite("requests", lambda t: t.slice(0, 0)), _name("rows"), \
        "request"
    yield "ref:blocks.request-unknown", rewrite("blocks", column("request", at(0, 7777))), \
        _name("blocks"), "request"
    yield "ref:violations.request-unknown", \
        rewrite("violations", column("request", at(0, 7777))), _name("violations"), "request"
    yield "ref:rows.step-unknown", rewrite("rows", column("step", lambda v: [*v[:-1], 99])), \
        _name("rows"), "step"
    yield "ref:steps-last-dropped", rewrite("steps", lambda t: t.slice(0, t.num_rows - 1)), \
        _name("rows"), "step"
    yield "ref:step-2^40", rewrite("steps", column("step", at(-1, 1 << 40))), _name("steps"), \
        "step"
    yield "dup:requests.request", rewrite("requests", append_copy(0)), _name("requests"), \
        "request"
    yield "dup:requests.request-renumbered", \
        rewrite("requests", column("request", every(0))), _name("requests"), "request"
    yield "dup:rows.step-request", rewrite("rows", append_copy(5, prev_row=-1, pages_keep=0,
                                                            alloc_keep=0)), \
        _name("rows"), "request"
    yield "dup:steps.step", rewrite("steps", column("step", at(1, 0))), _name("steps"), "step"
    yield "dup:blocks.seq", rewrite("blocks", column("seq", at(1, 0))), _name("blocks"), "seq"


def order_mutations() -> Iterator[tuple[str, Mutator, str, str]]:
    def swap(vals: list) -> list:
        return [vals[1], vals[0], *vals[2:]]
    yield "order:steps.step", rewrite("steps", column("step", swap)), _name("steps"), "step"
    yield "order:steps.t_launch_ns", rewrite("steps", column("t_launch_ns", swap)), \
        _name("steps"), "t_launch_ns"
    yield "order:rows.step", rewrite("rows", column("step", at(0, 3))), _name("rows"), "step"
    yield "order:blocks.seq", rewrite("blocks", column("seq", swap)), _name("blocks"), "seq"
    yield "time:arrival-negative", rewrite("requests", column("arrival_ns", at(1, -5))), \
        _name("requests"), "arrival_ns"
    yield "time:launch-negative", rewrite("steps", column("t_launch_ns", at(0, -1))), \
        _name("steps"), "t_launch_ns"


def null_mutations() -> Iterator[tuple[str, Mutator, str, str]]:
    """A null in one column of each table, and whole null columns (no column is nullable)."""
    for table, col in (("steps", "step"), ("steps", "backend"), ("rows", "request"),
                       ("rows", "phase"), ("rows", "prev_row"), ("requests", "finish_ns"),
                       ("requests", "finish_reason"), ("blocks", "block"),
                       ("blocks", "event"), ("violations", "request"),
                       ("violations", "message")):
        yield f"null:{table}.{col}", rewrite(table, column(col, at(0, None))), _name(table), col
    for table, col in (("steps", "t_sched_ns"), ("rows", "kv_len"), ("requests", "request")):
        yield f"null-column:{table}.{col}", rewrite(table, column(col, every(None))), \
            _name(table), col
    for table, col in (("rows", "tokens"), ("requests", "prompt_tokens"),
                       ("rows", "alloc")):
        yield f"null-in-list:{table}.{col}", rewrite(table, column(col, lambda v: [
            [None, *v[0]], *v[1:]])), _name(table), col


def length_mutations(model: dict) -> Iterator[tuple[str, Mutator, str, str]]:
    """A row's lengths and positions past what the model could reach (the checker walks them)."""
    slots = 2 * model["num_blocks"] * model["tokens_per_block"] + \
        model["max_position_embeddings"]
    for col in _LENGTHS:
        yield f"length:rows.{col}={slots + 1}", rewrite("rows", column(col, at(0, slots + 1))), \
            _name("rows"), col
    for col in ("append_pos", "rope_pos"):
        for bad in (slots + 1, -1):
            yield f"length:rows.{col}-{bad}", rewrite("rows", column(col, lambda v, b=bad: [
                [*v[0], b], *v[1:]])), _name("rows"), col


def list_mutations(num_blocks: int) -> Iterator[tuple[str, Mutator, str, str]]:
    for table, col in (("rows", "tokens"), ("requests", "prompt_tokens"),
                       ("requests", "output_tokens")):
        yield f"list:{table}.{col}-negative", rewrite(table, column(col, lambda v: [
            [-3, *v[0]], *v[1:]])), _name(table), col
    for bad in (num_blocks, -1, 1 << 30):
        yield f"list:rows.alloc={bad}", rewrite("rows", column("alloc", lambda v, b=bad: [
            [*v[0], b], *v[1:]])), _name("rows"), "alloc"
    yield "blocks.block=num_blocks", rewrite("blocks", column("block", at(0, num_blocks))), \
        _name("blocks"), "block"
    yield "blocks.num_tokens>B", rewrite("blocks", column("num_tokens", at(0, 10_000))), \
        _name("blocks"), "num_tokens"


def _many_rows(table: str, rows: int, agree: bool = True) -> Mutator:
    """`table` as a small file of `rows` identical rows (the manifest's counts agreeing, or
    left as they were), written as one repeated batch of constant columns."""
    def go(d: Path) -> None:
        t = pq.read_table(d / f"{table}.parquet")
        batch = t.take([0] * (1 << 20))
        with pq.ParquetWriter(d / f"{table}.parquet", t.schema, compression="none") as w:
            for _ in range(-(-rows // batch.num_rows)):
                w.write_table(batch)
        if agree:
            m = json.loads((d / "manifest.json").read_text())
            m["counts"][table] = pq.read_metadata(d / f"{table}.parquet").num_rows
            (d / "manifest.json").write_text(json.dumps(m))
    return go


def _special(rel: str, make: Callable[[Path], None]) -> Mutator:
    def go(d: Path) -> None:
        (d / rel).unlink()
        make(d / rel)
    return go


def file_mutations() -> Iterator[tuple[str, Mutator, str, str]]:
    """Files a reader must refuse before it reads them (a FIFO would block it for ever)."""
    yield "size:steps-too-many-rows", _many_rows("steps", MAX_ROWS + 1), _name("steps"), "rows"
    yield "size:blocks-more-rows-than-counts", _many_rows("blocks", 1 << 21, agree=False), \
        _name("blocks"), "counts.blocks"
    for table in ("steps", "rows"):
        yield f"fifo:{table}", _special(_name(table), os.mkfifo), _name(table), "regular file"
        yield f"device:{table}", _special(_name(table), lambda p: p.symlink_to("/dev/zero")), \
            _name(table), "regular file"
    yield "fifo:manifest", _special("manifest.json", os.mkfifo), "manifest.json", \
        "regular file"
    yield "device:manifest", _special("manifest.json", lambda p: p.symlink_to("/dev/zero")), \
        "manifest.json", "regular file"

    def oversize(p: Path) -> None:
        with open(p, "wb") as fh:  # sparse: no disk
            fh.truncate(MAX_MANIFEST_BYTES + 1)
    yield "size:manifest", _special("manifest.json", oversize), "manifest.json", "size"

    def nested(p: Path) -> None:
        p.write_text("[" * 100_000 + "]" * 100_000)
    yield "manifest-deeply-nested", _special("manifest.json", nested), "manifest.json", "JSON"

    def huge_int(d: Path) -> None:  # past Python's int-from-text digit limit
        text = (d / "manifest.json").read_text()
        (d / "manifest.json").write_text(re.sub(r'"seed": -?[0-9]+', '"seed": ' + "9" * 5000,
                                                text, count=1))
    yield "manifest-5000-digit-int", huge_int, "manifest.json", "JSON"


def trace_mutations(model: dict) -> Iterator[tuple[str, Mutator, str, str]]:
    """(name, mutation of a copy of a valid trace dir, file, field the message must name);
    `model`: the valid trace's manifest model."""
    yield from range_mutations()
    yield from length_mutations(model)
    yield from enum_mutations()
    yield from reference_mutations()
    yield from order_mutations()
    yield from null_mutations()
    yield from list_mutations(model["num_blocks"])
    yield from file_mutations()

