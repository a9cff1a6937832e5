"""rows.parquet's delta-encoded page lists (trace format_versions 2 and 3, sim/trace/delta.py).

The encoder is held to a Python model of the rule (prev_row = the request's previous row within
WINDOW, keep = common prefix) however the rows are batched; decoding gives back the logical
lists; the reader refuses every reference that does not resolve; format 1 traces read to the
same logical tables; both engines store the same table.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sim.fast.engine as fast_engine
import sim.trace.delta as delta
from sim.api import load_scenario, run
from sim.errors import TraceError
from sim.trace.delta import RowEncoder, decode_rows
from sim.trace.reader import read_trace, table_digest
from sim.trace.records import FORMAT_VERSION, RowRecord
from sim.trace.schema import RUN_COLUMNS, RUN_LISTS, SCHEMAS, STORED, TABLES
from sim.trace.writer import TraceWriter, columnar, columnar_arrow

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"tokens_per_block": 4, "num_blocks": 64}
Row = tuple[int, list[int], list[int]]  # request, pages, alloc


# -- row sequences: requests interleaved, lists that grow, shrink, change, empty ---------------
_IDS = st.lists(st.integers(-1, 9), max_size=5)  # few ids: prefixes shared by chance; -1 padding


@st.composite
def _evolve(draw: st.DrawFn, ids: list[int]) -> list[int]:
    op = draw(st.sampled_from(["same", "grow", "shrink", "replace", "empty", "edit"]))
    if op == "grow":
        return ids + draw(_IDS)
    if op == "shrink":
        return ids[:draw(st.integers(0, len(ids)))]
    if op == "replace":
        return draw(_IDS)
    if op == "edit" and ids:
        i = draw(st.integers(0, len(ids) - 1))
        return ids[:i] + [ids[i] + 1] + ids[i + 1:]
    return [] if op == "empty" else ids


@st.composite
def row_sequences(draw: st.DrawFn) -> list[Row]:
    now: dict[int, tuple[list[int], list[int]]] = {}
    rows = []
    for _ in range(draw(st.integers(0, 40))):
        r = draw(st.integers(0, 4))
        pages, alloc = now.get(r, ([], []))
        now[r] = (draw(_evolve(pages)), draw(_evolve(alloc)))
        rows.append((r, *now[r]))
    return rows


def _batches(draw_cuts: list[int], rows: list[Row]) -> list[list[Row]]:
    cuts = [0, *sorted(set(draw_cuts)), len(rows)]
    return [rows[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


# -- the rule, in Python --------------------------------------------------------------------
def _prefix(a: list[int], b: list[int]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def model_encoding(rows: list[Row], window: int) -> list[tuple[int, int, int, list, list]]:
    """(prev_row, pages_keep, alloc_keep, pages tail, alloc tail) per row."""
    last: dict[int, int] = {}
    out = []
    for i, (r, pages, alloc) in enumerate(rows):
        p = last.get(r, -1)
        if p >= 0 and i - p > window:
            p = -1
        kp = _prefix(rows[p][1], pages) if p >= 0 else 0
        ka = _prefix(rows[p][2], alloc) if p >= 0 else 0
        out.append((p, kp, ka, pages[kp:], alloc[ka:]))
        last[r] = i
    return out


# -- helpers -----------------------------------------------------------------------------------
def _cols(rows: list[Row], positions: list[list[int]] | None = None) -> dict[str, object]:
    req, pages, alloc = zip(*rows, strict=True) if rows else ((), (), ())
    pos = columnar(positions if positions is not None else [[]] * len(rows),
                   pa.list_(pa.int32()))
    return {"request": np.array(req, np.int64), "pages": columnar(pages, pa.list_(pa.int32())),
            "alloc": columnar(alloc, pa.list_(pa.int32())), "append_pos": pos, "rope_pos": pos}


def _table(schema: pa.Schema, cols: dict[str, object], n: int) -> pa.Table:
    """A table of `schema` with `cols`; the other columns zeros / empty (the codec ignores them)."""
    fill = {pa.string(): np.full(n, "gen", object), pa.bool_(): np.zeros(n, bool)}
    arrays = []
    for f in schema:
        v = cols.get(f.name)
        if v is None:
            v = ((np.zeros(n + 1, np.int32), np.zeros(0, np.int32))
                 if pa.types.is_list(f.type) else fill.get(f.type, np.zeros(n, np.int64)))
        arrays.append(columnar_arrow(v, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _encode(batches: list[list[Row]]) -> pa.Table:
    enc = RowEncoder()
    parts = [_table(STORED["rows"], enc.encode(_cols(b)), len(b)) for b in batches]
    return pa.concat_tables([_table(STORED["rows"], {}, 0), *parts])


def _stored_rows(t: pa.Table) -> list[tuple]:
    cols = [t.column(c).to_pylist() for c in ("prev_row", "pages_keep", "alloc_keep",
                                               "pages", "alloc")]
    return list(zip(*cols, strict=True))


# -- encoding and decoding ---------------------------------------------------------------------
@given(rows=row_sequences(), cuts=st.lists(st.integers(0, 40), max_size=4),
       window=st.sampled_from([delta.WINDOW, 1, 3]))
def test_encoding_follows_the_rule_however_batched_and_decodes_back(rows, cuts, window):
    with mock.patch.object(delta, "WINDOW", window):
        stored = _encode(_batches([c for c in cuts if c <= len(rows)], rows))
    assert _stored_rows(stored) == [tuple(x) for x in model_encoding(rows, window)]
    logical = decode_rows(stored, "rows.parquet")
    assert logical.schema == SCHEMAS["rows"]
    assert logical.column("pages").to_pylist() == [p for _, p, _ in rows]
    assert logical.column("alloc").to_pylist() == [a for _, _, a in rows]


def test_decode_goes_through_chains_of_rows_and_keeps_the_other_columns():
    rows: list[Row] = [(7, [1, 2], [1, 2]), (8, [5], []), (7, [1, 2, 3], [1, 2, 3]),
                       (7, [1, 2, 3, 4], [1, 9]), (8, [], [6])]
    stored = _encode([rows[:2], rows[2:]])
    assert _stored_rows(stored) == [(-1, 0, 0, [1, 2], [1, 2]), (-1, 0, 0, [5], []),
                                    (0, 2, 2, [3], [3]), (2, 3, 1, [4], [9]),
                                    (1, 0, 0, [], [6])]
    logical = decode_rows(stored, "rows.parquet")
    assert logical.column("pages").to_pylist() == [[1, 2], [5], [1, 2, 3], [1, 2, 3, 4], []]
    assert logical.column("request").to_pylist() == [7, 8, 7, 7, 8]


def test_a_list_column_too_large_for_arrow_is_refused():
    stored = _encode([[(0, [1, 2, 3], [])]])
    with mock.patch.object(delta, "_I32_MAX", 2), pytest.raises(TraceError) as err:
        decode_rows(stored, "x/rows.parquet")
    assert str(err.value) == ("x/rows.parquet: pages holds 3 ids in all, more than one Arrow "
                              "list column takes (2): the trace is too large to read into memory")


# -- positions: a leading run, then a tail (format 3) --------------------------------------------
def _run_of(v: list[int]) -> tuple[int, int]:
    k = 1 if v else 0
    while k < len(v) and v[k] == v[0] + k:
        k += 1
    return (v[0] if v else 0), k


_POSITIONS = st.lists(st.one_of(
    st.builds(lambda a, n: list(range(a, a + n)), st.integers(-3, 2**31 - 9), st.integers(0, 6)),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4),
    st.builds(lambda a, t: list(range(a, a + 3)) + t, st.integers(0, 9),
              st.lists(st.integers(0, 12), max_size=3))), max_size=30)


@given(positions=_POSITIONS, cuts=st.lists(st.integers(0, 30), max_size=3))
def test_positions_store_their_leading_run_and_decode_back(positions, cuts):
    rows: list[Row] = [(i, [], []) for i in range(len(positions))]
    cuts = [0, *sorted({c for c in cuts if c <= len(rows)}), len(rows)]
    enc = RowEncoder()
    parts = [_table(STORED["rows"], enc.encode(_cols(rows[a:b], positions[a:b])), b - a)
             for a, b in zip(cuts, cuts[1:], strict=False)]
    stored = pa.concat_tables([_table(STORED["rows"], {}, 0), *parts])
    for name in ("append_pos", "rope_pos"):
        got = zip(stored.column(f"{name}_start").to_pylist(),
                  stored.column(f"{name}_run").to_pylist(), stored.column(name).to_pylist(),
                  strict=True)
        assert list(got) == [(*_run_of(v), v[_run_of(v)[1]:]) for v in positions]
        assert decode_rows(stored, "rows.parquet").column(name).to_pylist() == positions


@pytest.mark.parametrize("start, run, tail, why", [
    (5, -1, [], "row 0: append_pos_run -1 is negative"),
    (2**31 - 2, 3, [], "row 0: append_pos_start 2147483646 + append_pos_run 3 leaves int32"),
    (-(2**31) - 1, 1, [], "row 0: append_pos_start -2147483649 + append_pos_run 1 leaves"),
    (4, 0, [4], "row 0: append_pos_start 4 with append_pos_run 0 (nothing to start: must be 0)"),
])
def test_the_decoder_refuses_runs_that_do_not_fit(start, run, tail, why):
    stored = _encode([[(0, [], [])]])
    i = stored.schema.get_field_index
    stored = stored.set_column(i("append_pos_start"), "append_pos_start", pa.array([start]))
    stored = stored.set_column(i("append_pos_run"), "append_pos_run", pa.array([run]))
    stored = stored.set_column(i("append_pos"), STORED["rows"].field("append_pos"),
                               pa.array([tail], pa.list_(pa.int32())))
    with pytest.raises(TraceError, match=re.escape(f"x/rows.parquet: {why}")):
        decode_rows(stored, "x/rows.parquet")


# -- the writer --------------------------------------------------------------------------------
def _write(out: Path, batches: list[list[Row]], records: bool) -> Path:
    """Rows through TraceWriter: as column batches (fast engine) or as records (reference)."""
    w = TraceWriter(out)
    for b in batches:
        full = _table(SCHEMAS["rows"], _cols(b), len(b))
        if records:
            for d in full.to_pylist():
                w.add("rows", RowRecord(**{k: tuple(v) if isinstance(v, list) else v
                                           for k, v in d.items()}))
        else:
            w.add_columns("rows", {f.name: _numpy(full.column(f.name), f.type)
                                   for f in SCHEMAS["rows"]})
    return w.close([], {"model": MODEL})


def _numpy(col: pa.ChunkedArray, t: pa.DataType) -> object:
    a = col.combine_chunks()
    if pa.types.is_list(t):
        return np.array(a.offsets), np.array(a.values)
    return np.array(a.to_numpy(zero_copy_only=False))


@given(rows=row_sequences(), cuts=st.lists(st.integers(0, 40), max_size=4))
def test_writer_round_trip_and_one_digest_however_the_rows_came(tmp_path_factory, rows, cuts):
    tmp = tmp_path_factory.mktemp("w")
    batches = _batches([c for c in cuts if c <= len(rows)], rows)
    # rows alone, with any ids: the codec's round trip, not a trace's content
    a = read_trace(_write(tmp / "columns", batches, records=False), content=False)
    b = read_trace(_write(tmp / "records", [rows], records=True), content=False)
    assert a.manifest["format_version"] == FORMAT_VERSION == 3
    assert a.manifest["digest"] == b.manifest["digest"]
    assert a.tables["rows"].column("pages").to_pylist() == [p for _, p, _ in rows]
    assert a.tables["rows"].column("alloc").to_pylist() == [al for _, _, al in rows]
    assert a.tables["rows"].equals(b.tables["rows"])


# -- the reader refuses references that do not resolve ----------------------------------------
def _trace_v2(root: Path, prev: list[int], kp: list[int], request: list[int]) -> Path:
    """A format 2 trace by hand, with a consistent digest, so read_trace reaches the decoder.
    Three rows: pages [1, 2], then tails [3] and []; alloc all empty."""
    cols = {"request": np.array(request, np.int64), "prev_row": np.array(prev, np.int64),
            "pages_keep": np.array(kp, np.int64),
            "pages": (np.array([0, 2, 3, 3], np.int32), np.array([1, 2, 3], np.int32))}
    tables = {n: _table(STORED[n], cols if n == "rows" else {}, 3 if n == "rows" else 0)
              for n in TABLES}
    root.mkdir()
    for n, t in tables.items():
        pq.write_table(t, root / f"{n}.parquet")
    (root / "manifest.json").write_text(json.dumps({
        "format_version": 2, "model": MODEL, "complete": True,
        "counts": {n: t.num_rows for n, t in tables.items()},
        "digest": table_digest([tables[n] for n in TABLES], 2)}))
    return root


@pytest.mark.parametrize("prev, keep, requests, problem", [
    ([-1, 0, 1], [0, 2, 3], [0, 0, 0], None),
    ([-1, 1, 1], [0, 0, 0], [0, 0, 0], "row 1: prev_row 1 is not an earlier row "
                                       "(-1 <= prev_row < row)"),
    ([-1, 0, 2], [0, 0, 0], [0, 0, 0], "row 2: prev_row 2 is not an earlier row"),
    ([-1, 0, -2], [0, 0, 0], [0, 0, 0], "row 2: prev_row -2 is not an earlier row"),
    ([-1, 0, 0], [0, 0, 0], [0, 0, 1], "row 2: prev_row 0 is a row of another request"),
    ([-1, 0, 1], [0, 2, 4], [0, 0, 0], "row 2: pages_keep 4 is more than the 3 ids of row "
                                       "prev_row 1"),
    ([-1, 0, 1], [0, -1, 0], [0, 0, 0], "row 1: pages_keep -1 is negative"),
    ([-1, 0, -1], [0, 0, 1], [0, 0, 0], "row 2: pages_keep 1 with prev_row -1 (nothing to "
                                        "keep: must be 0)"),
])
def test_the_decoder_refuses_references_that_do_not_resolve(tmp_path, prev, keep, requests,
                                                            problem):
    root = _trace_v2(tmp_path / "t", prev, keep, requests)
    if problem is None:  # the good one: [1, 2], [1, 2, 3], [1, 2, 3]
        rows = read_trace(root, content=False).tables["rows"]
        assert rows.column("pages").to_pylist() == [[1, 2], [1, 2, 3], [1, 2, 3]]
        return
    with pytest.raises(TraceError) as err:
        read_trace(root, content=False)
    assert str(err.value).startswith(f"{root / 'rows.parquet'}: {problem}")


def test_the_digest_is_checked_before_decoding(tmp_path):
    root = _trace_v2(tmp_path / "t", [-1, 0, 1], [0, 2, 3], [0, 0, 0])
    t = pq.read_table(root / "rows.parquet")
    bad = t.set_column(t.schema.get_field_index("prev_row"), "prev_row",
                       pa.array([-1, 0, 5], pa.int64()))
    pq.write_table(bad, root / "rows.parquet")
    with pytest.raises(TraceError, match="digest mismatch"):
        read_trace(root)


# -- format 1 and the engines ------------------------------------------------------------------
def _vidur(n: int):  # type: ignore[no-untyped-def]
    sc, base = load_scenario(ROOT / "bench" / "workloads" / "a_vidur.toml")
    syn = sc.workload.synthetic.model_copy(update={"num_requests": n})  # type: ignore[union-attr]
    wl = sc.workload.model_copy(update={"synthetic": syn})
    return sc.model_copy(update={"workload": wl}), base


def _as_older(src: Path, out: Path, version: int) -> Path:
    """The same trace in an older format: 1 stores the logical tables as they are; 2 stores
    what 3 stores but positions as whole lists (no run columns), under a sha256 digest."""
    logical = read_trace(src).tables
    tables = logical if version == 1 else {n: pq.read_table(src / f"{n}.parquet")
                                           for n in TABLES}
    if version == 2:
        rows = tables["rows"].drop_columns(list(RUN_COLUMNS))
        for name in RUN_LISTS:
            rows = rows.set_column(rows.schema.get_field_index(name), name,
                                   logical["rows"].column(name))
        tables = dict(tables, rows=rows)
    out.mkdir()
    for n in TABLES:
        pq.write_table(tables[n], out / f"{n}.parquet")
    man = json.loads((src / "manifest.json").read_text())
    man.update(format_version=version, digest=table_digest([tables[n] for n in TABLES], version))
    (out / "manifest.json").write_text(json.dumps(man))
    return out


@pytest.mark.parametrize("version", [1, 2])
def test_older_formats_read_to_the_same_logical_tables(tmp_path, version):
    sc, base = _vidur(20)
    new = run(sc, out=tmp_path / "new", base_dir=base, collect=False).trace_dir
    old = _as_older(new, tmp_path / f"v{version}", version)  # type: ignore[arg-type]
    a, b = read_trace(new), read_trace(old)  # type: ignore[arg-type]
    assert (a.manifest["format_version"], b.manifest["format_version"]) == (3, version)
    assert a.manifest["digest"] != b.manifest["digest"]  # another hash (and, for 1, tables)
    assert a.tables["rows"].num_rows > 100
    for n in TABLES:
        assert a.tables[n].equals(b.tables[n]), n


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("window", [delta.WINDOW, 7])
def test_both_engines_store_the_same_rows(tmp_path, window, check):
    """Batched differently (the fast engine per 8 steps here, the reference per 8192 records),
    the same stored table: one digest. A small window makes the carry between batches drop
    rows. Checked, the fast engine hands whole lists to RowEncoder; unchecked, its kernel
    stores them itself (sim/fast/stored.py page_lists), never calling the encoder."""
    sc, base = _vidur(30)
    digests = {}
    with mock.patch.object(delta, "WINDOW", window), mock.patch.object(fast_engine, "_STEPS", 8):
        for e in ("fast", "reference"):
            kernel_encodes = e == "fast" and not check
            with mock.patch.object(delta.RowEncoder, "encode", side_effect=AssertionError(
                    "the kernel stores the rows")) if kernel_encodes else contextlib.nullcontext():
                run(sc, out=tmp_path / e, base_dir=base, engine=e, collect=False, check=check)
            digests[e] = json.loads((tmp_path / e / "manifest.json").read_text())["digest"]
    assert digests["fast"] == digests["reference"]
    whole = int((pq.read_table(tmp_path / "fast" / "rows.parquet").column("prev_row")
                 .to_numpy() == -1).sum())
    if window == delta.WINDOW:
        assert whole == 30  # each request's first row
    else:
        assert whole > 30  # rows more than 7 back are stored whole
    fast, ref = (read_trace(tmp_path / e).tables["rows"] for e in ("fast", "reference"))
    assert fast.equals(ref)


@pytest.mark.parametrize("first", [True, False])
def test_one_trace_takes_rows_encoded_one_way_only(tmp_path, first):
    """prev_row counts rows from the trace's first: rows the caller encoded (the fast
    engine's kernel) and rows the writer encodes cannot share a trace."""
    rows = [(0, [3, 4], [3, 4]), (1, [5], [5]), (0, [3, 4, 6], [3, 4, 6])]
    full = _table(SCHEMAS["rows"], _cols(rows), len(rows))
    logical = {f.name: _numpy(full.column(f.name), f.type) for f in SCHEMAS["rows"]}
    w = TraceWriter(tmp_path / "t")
    try:
        stored = RowEncoder().encode(logical)
        w.add_columns("rows", stored if first else logical, encoded=first)
        with pytest.raises(ValueError, match="one way per trace"):
            w.add_columns("rows", logical if first else stored, encoded=not first)
    finally:
        w.abort()
