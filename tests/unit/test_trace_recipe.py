"""docs/trace.md's recipes decode rows.parquet without kvsim: run as written in the doc, on the
default scenario's trace, they give kvsim's reader's lists at every row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sim.api import run
from sim.config import load_scenario
from sim.trace.reader import read_trace
from sim.trace.records import FORMAT_VERSION
from sim.trace.schema import TABLES

duckdb = pytest.importorskip("duckdb")
pd = pytest.importorskip("pandas")

ROOT = Path(__file__).resolve().parents[2]
LISTS = ("pages", "alloc", "append_pos", "rope_pos")


def _recipe(lang: str) -> str:
    doc = (ROOT / "docs" / "trace.md").read_text()
    section = doc.split("### Reading rows.parquet without kvsim", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{lang}\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"docs/trace.md should hold one {lang} recipe, has {len(blocks)}"
    return blocks[0]


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("recipe") / "trace"
    sc, base = load_scenario(ROOT / "scenarios" / "default.toml")
    run(sc, out=out, base_dir=base)
    return out


def _truth(trace: Path) -> list[tuple]:
    rows = read_trace(trace).tables["rows"]
    cols = [rows.column(c).to_pylist() for c in ("step", "row", "request", *LISTS)]
    return list(zip(*cols, strict=True))


def test_the_duckdb_recipe_returns_the_true_lists(trace: Path) -> None:
    con = duckdb.connect()
    con.execute(f"SET file_search_path = '{trace}'")
    got = [tuple(r) for r in con.execute(_recipe("sql")).fetchall()]
    truth = _truth(trace)
    assert len(got) == len(truth) == json.loads((trace / "manifest.json").read_text())[
        "counts"]["rows"]
    assert got == truth
    # the issue's example: raw, step 33's first row shows no pages; decoded, its page table
    raw = con.execute("SELECT pages FROM 'rows.parquet' WHERE step = 33 AND request = 0")
    assert raw.fetchall() == [([],)]
    assert [r[3] for r in got if r[0] == 33 and r[2] == 0] == [[0, 1, 2, 3, 4, 5, 6, 99]]


def test_the_pandas_recipe_returns_the_true_lists(trace: Path, monkeypatch) -> None:
    monkeypatch.chdir(trace)
    scope: dict = {}
    exec(_recipe("python"), scope)  # noqa: S102 - the doc's own recipe, as a user runs it
    rows = scope["rows"]
    got = list(zip(*(rows[c].tolist() for c in ("step", "row", "request")),
                   *([list(x) for x in rows[c]] for c in LISTS), strict=True))
    assert got == _truth(trace)


def test_every_file_names_its_format_and_rows_its_encoding(trace: Path) -> None:
    for name in TABLES:
        meta = pq.read_metadata(trace / f"{name}.parquet").metadata
        assert meta[b"kvsim.format_version"] == str(FORMAT_VERSION).encode()
        assert meta[b"kvsim.table"] == name.encode()
        assert b"docs/trace.md" in meta[b"kvsim.doc"]
    meta = pq.read_metadata(trace / "rows.parquet").metadata
    encoding = json.loads(meta[b"kvsim.encoding"])
    stored = pq.read_schema(trace / "rows.parquet").names
    assert set(encoding) <= set(stored)
    assert {"pages", "alloc", "prev_row", "pages_keep", "alloc_keep", "append_pos",
            "rope_pos"} <= set(encoding)
    assert "docs/trace.md" in meta[b"kvsim.decode"].decode()
