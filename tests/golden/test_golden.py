"""Golden traces: same scenario + seed + version => byte-identical tables and the same digest.

The pinned digests are the "process replay" of this project: a change that moves them changes
what the simulator does. If that is intended, regenerate them and say so in the commit message:
    kvsim run scenarios/NAME.toml --out /tmp/g && jq .digest /tmp/g/manifest.json

The digest is over the tables as stored, so a change of the stored format moves it too: trace
format_version 2 (delta-encoded page lists in rows.parquet) did, with every logical table (as
sim.trace.reader.read_trace returns them) equal to format 1's for both scenarios. So does a
change of the digest's hash and the stored positions: format 3 (xxh3-128 per column,
sim/trace/digest.py; append_pos and rope_pos as a leading run and a tail) stores format 2's
tables but for those positions; put back as whole lists, format 2's (sha256) digest is pinned.
"""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sim.api import load_scenario, run
from sim.trace.reader import read_trace, table_digest
from sim.trace.schema import RUN_COLUMNS, RUN_LISTS, TABLES

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = {
    "worked_example": "b1d5ff8b1c3a87f5bf042b521db2320eaa04f03467fb4abcc44017165b21648c",
    "default": "d8e8d980461f95bcee922bfb3b5ec08d6967536c9453aba621743d06d33e464a",
}
# the same scenarios' digests as format 2 wrote them (kvsim before format 3)
FORMAT_2 = {
    "worked_example": "9099162c67001d52e2a4df88faf6db4f5c772206ed31af85ff9e479aea519afa",
    "default": "2109371ab85fed37ce821a7f7fd9cc7ffcdda2bf43b8b934d05b212ebaef3c41",
}


def _trace(tmp: Path, name: str, seed: int | None = None) -> Path:
    sc, base = load_scenario(ROOT / "scenarios" / f"{name}.toml")
    if seed is not None:
        sc = sc.model_copy(update={"seed": seed})
    return run(sc, out=tmp, base_dir=base).trace_dir  # type: ignore[return-value]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_digest_is_pinned(tmp_path, name):
    t = _trace(tmp_path / "t", name)
    man = json.loads((t / "manifest.json").read_text())
    assert (man["format_version"], man["digest"]) == (3, GOLDEN[name])
    # Positions put back as whole lists, the files are format 2's: under its hash they give
    # its pinned digest, and with its manifest they read (sha256 verified) to the same tables.
    tables = read_trace(t).tables
    v2_dir = _as_format_2(t, tables["rows"], tmp_path / "v2")
    assert table_digest([pq.read_table(v2_dir / f"{n}.parquet") for n in TABLES], 2) \
        == FORMAT_2[name]
    (v2_dir / "manifest.json").write_text(json.dumps(dict(man, format_version=2,
                                                          digest=FORMAT_2[name])))
    v2 = read_trace(v2_dir)
    assert v2.manifest["format_version"] == 2
    for n in TABLES:
        assert v2.tables[n].equals(tables[n]), n


def _as_format_2(t: Path, logical_rows: pa.Table, out: Path) -> Path:
    out.mkdir()
    for n in TABLES:
        table = pq.read_table(t / f"{n}.parquet")
        if n == "rows":
            table = table.drop_columns(list(RUN_COLUMNS))
            for c in RUN_LISTS:
                table = table.set_column(table.schema.get_field_index(c), c,
                                         logical_rows.column(c))
        pq.write_table(table, out / f"{n}.parquet")
    return out


def test_two_runs_are_byte_identical(tmp_path):
    a, b = _trace(tmp_path / "a", "default"), _trace(tmp_path / "b", "default")
    for name in TABLES:
        assert (a / f"{name}.parquet").read_bytes() == (b / f"{name}.parquet").read_bytes(), name


def test_another_seed_gives_another_trace(tmp_path):
    t = _trace(tmp_path / "t", "default", seed=8)
    assert json.loads((t / "manifest.json").read_text())["digest"] != GOLDEN["default"]
