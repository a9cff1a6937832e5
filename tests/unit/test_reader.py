"""read_trace refuses anything that is not a whole trace; check_trace replays a good one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_check_support import MODEL, Events, ctx, gen, step

from sim.check.offline import check_trace
from sim.errors import TraceError
from sim.trace.reader import iter_records, read_trace, table_digest
from sim.trace.records import READABLE_VERSIONS, RequestRecord
from sim.trace.schema import ON_DISK, SCHEMAS, TABLES


def _table(name: str, recs: list) -> pa.Table:
    cols = {f: [getattr(r, f) for r in recs] for f in SCHEMAS[name].names}
    return pa.table({k: [list(x) if isinstance(x, tuple) else x for x in v]
                     for k, v in cols.items()}, schema=SCHEMAS[name])


def _records() -> dict[str, list]:
    ev = Events()
    blocks = [ev(0, "alloc", 1, 0, 1), ev(0, "alloc", 2, 0, 1),
              ev(0, "done", -1, -1, 0, phase="proc", src=0),
              ev(1, "done", -1, -1, 0, phase="proc", src=1),
              ev(1, "free", 2, 0, 0, phase="proc"), ev(1, "free", 1, 0, 0, phase="proc")]
    return {"steps": [step(0, backend="xqa"), step(1, backend="xqa")],
            "rows": [ctx(), gen()], "requests": [REQUEST], "blocks": blocks, "violations": []}


# the rows' request: a trace's rows name requests of requests.parquet (sim/trace/validate.py)
REQUEST = RequestRecord(0, 0, 6, 2, (1, 2, 3, 4, 5, 6), (7,), 0, 10, -1, "unfinished", 0, 1, 0,
                        1)


def write(root: Path, recs: dict[str, list] | None = None, **manifest: object) -> Path:
    recs = recs or _records()
    tables = {n: _table(n, recs[n]) for n in TABLES}
    root.mkdir()
    for n, t in tables.items():
        pq.write_table(t, root / f"{n}.parquet")
    man = {"format_version": 1, "kvsim_version": "0.1.0", "model": MODEL, "seed": 0,
           "counts": {n: t.num_rows for n, t in tables.items()}, "violations": 0,
           "digest": table_digest([tables[n] for n in TABLES], 1), "complete": True}
    man.update(manifest)
    (root / "manifest.json").write_text(json.dumps(man))
    return root


def test_a_good_trace_reads_and_replays_clean(tmp_path: Path) -> None:
    root = write(tmp_path / "t")
    trace = read_trace(root)
    kinds = [type(x).__name__ for x in iter_records(trace)]
    assert kinds == ["BlockEvent", "BlockEvent", "tuple", "BlockEvent", "tuple", "BlockEvent",
                     "BlockEvent", "BlockEvent"]
    assert check_trace(root) == []


def test_replay_reports_what_the_records_show(tmp_path: Path) -> None:
    recs = _records()
    recs["rows"][1] = gen(reserved=7)
    out = check_trace(write(tmp_path / "t", recs))
    assert [v.message for v in out] == ["I1 step 1 req 0: reservation C=7 does not cover "
                                        "committed 6 + 2 written = 8"]


@pytest.mark.parametrize("version", READABLE_VERSIONS)
def test_digest_ignores_chunking_but_not_values(version: int) -> None:
    t = _table("steps", [step(0), step(1)])
    empty = [ON_DISK[version][n].empty_table() for n in TABLES[1:]]
    chunked = pa.concat_tables([t.slice(0, 1), t.slice(1)])
    assert table_digest([t, *empty], version) == table_digest([chunked, *empty], version)
    other = _table("steps", [step(0), step(2)])
    assert table_digest([t, *empty], version) != table_digest([other, *empty], version)


@pytest.mark.parametrize("breakage, message", [
    ("nodir", "trace directory does not exist"),
    ("nomanifest", "manifest.json is missing: not a trace, or one whose writing never finished"),
    ("partial", "manifest.json lacks \"complete\": true: the trace was not finished"),
    ("version", "manifest.json: format_version 4, this kvsim reads 1 or 2 or 3"),
    ("notable", "rows.parquet is missing"),
    ("truncated", "rows.parquet is unreadable (truncated or corrupt)"),
    ("column", "rows.parquet lacks columns ['pages']"),
    ("count", "rows.parquet: counts.rows: the manifest says 3 rows (got 2)"),
    ("digest", "digest mismatch: manifest.json says 00, the tables hash to"),
])
def test_refusals(tmp_path: Path, breakage: str, message: str) -> None:
    root = tmp_path / "t"
    if breakage != "nodir":
        write(root, **{"partial": {"complete": False}, "version": {"format_version": 4},
                       "count": {"counts": {"rows": 3}}, "digest": {"digest": "00"}}
              .get(breakage, {}))
    man = root / "manifest.json"
    if breakage == "nomanifest":
        man.unlink()
    elif breakage == "notable":
        (root / "rows.parquet").unlink()
    elif breakage == "truncated":
        data = (root / "rows.parquet").read_bytes()
        (root / "rows.parquet").write_bytes(data[: len(data) // 2])
    elif breakage == "column":
        pq.write_table(pq.read_table(root / "rows.parquet").drop_columns(["pages"]),
                       root / "rows.parquet")
    with pytest.raises(TraceError) as err:
        read_trace(root)
    assert message in str(err.value)
    assert str(root) in str(err.value)


def test_records_round_trip(tmp_path: Path) -> None:
    trace = read_trace(write(tmp_path / "t"))
    launches = [x for x in iter_records(trace) if isinstance(x, tuple)]
    assert launches[1] == (step(1, backend="xqa"), [gen()])
    assert dataclasses.asdict(launches[0][1][0]) == dataclasses.asdict(ctx())


def test_statistics_where_readers_filter_and_codecs_where_they_pay(tmp_path: Path) -> None:
    """step and request have min/max per row group (a filtered read skips groups); the other
    columns none, their cost without a use (sim/trace/writer.py _stat_columns)."""
    from sim.api import parse_scenario, run

    sc = parse_scenario({"spec": {"mode": "none"}, "overlap": {"enabled": False},
                         "cache": {"reuse": "off", "tokens_per_block": 4, "num_blocks": 32},
                         "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 9,
                                                    "output_len": 5}]}})
    out = run(sc, out=tmp_path / "t", collect=False).trace_dir
    assert out is not None
    for name in ("rows", "blocks", "steps"):
        group = pq.ParquetFile(out / f"{name}.parquet").metadata.row_group(0)
        with_stats = {group.column(i).path_in_schema for i in range(group.num_columns)
                      if group.column(i).is_stats_set}
        assert with_stats == {"step", "request"} & set(pq.read_schema(out / f"{name}.parquet")
                                                       .names), name
    group = pq.ParquetFile(out / "rows.parquet").metadata.row_group(0)
    codecs = {group.column(i).path_in_schema: group.column(i).compression
              for i in range(group.num_columns)}
    assert (codecs["tokens.list.element"], codecs["pages.list.element"]) == ("LZ4", "LZ4")
    # ordinals that jump between interleaved requests, and token ids, split by byte (lz4 then
    # takes the ids' zero high bytes); what climbs, delta-encoded
    encodings = {group.column(i).path_in_schema: group.column(i).encodings
                 for i in range(group.num_columns)}
    assert "BYTE_STREAM_SPLIT" in encodings["request"]
    assert "BYTE_STREAM_SPLIT" in encodings["tokens.list.element"]
    assert "DELTA_BINARY_PACKED" in encodings["step"]
    assert "DELTA_BINARY_PACKED" in encodings["pages.list.element"]
    req = pq.ParquetFile(out / "requests.parquet").metadata.row_group(0)
    assert {"BYTE_STREAM_SPLIT"} <= {e for i in range(req.num_columns)
                                     if "tokens" in req.column(i).path_in_schema
                                     for e in req.column(i).encodings}
    t = pq.read_table(out / "rows.parquet", filters=[("step", ">=", 3)])
    assert t.num_rows and min(t.column("step").to_pylist()) == 3
