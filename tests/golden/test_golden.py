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
    "worked_example": "f080d750ee81f8b7a4af5609a581520af1e59028703246d854a1aa755be5b59f",
    "default": "1c0985a7e38e3ecace48f4d29c40989309257ca59f42af7210de5dbe7ec0f0db",
}
# the same scenarios' digests as format 2 wrote them (kvsim before format 3)
FORMAT_2 = {
    "worked_example": "8649be09a1a1d95f2b33422a1c3241bd5eac9f1dd68fc59a6c314e6936ec9575",
    "default": "1c3b6b8a6d46abe904120dab07eb77604e98228006c43d7d826f1a2542fc7530",
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
