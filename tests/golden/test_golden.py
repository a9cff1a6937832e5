"""Golden traces: same scenario + seed + version => byte-identical tables and the same digest.

The pinned digests are the "process replay" of this project: a change that moves them changes
what the simulator does. If that is intended, regenerate them and say so in the commit message:
    kvsim run scenarios/NAME.toml --out /tmp/g && jq .digest /tmp/g/manifest.json

The digest is over the tables as stored, so a change of the stored format moves it too: trace
format_version 2 (delta-encoded page lists in rows.parquet) did, with every logical table (as
sim.trace.reader.read_trace returns them) equal to format 1's for both scenarios. So does a
change of the digest's hash: format 3 (xxh3-128 per column, sim/trace/digest.py) stores the same
Parquet files, byte for byte, as format 2 did; their format 2 (sha256) digest is still pinned.
"""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sim.api import load_scenario, run
from sim.trace.reader import read_trace, table_digest
from sim.trace.schema import TABLES

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = {
    "worked_example": "910d0ee987a5a8cbb5b7521f83bcf34161e61871c807d768f385794654a90b5d",
    "default": "90cb1182f43dcba8e52dc1eeb52b69279cf0432388d10992403313f1b9abde1d",
}
# the same scenarios' digests as format 2 wrote them (kvsim before format 3)
FORMAT_2 = {
    "worked_example": "8649be09a1a1d95f2b33422a1c3241bd5eac9f1dd68fc59a6c314e6936ec9575",
    "default": "01d8970de98f5d8f9204b2fc4fba38137a07da6454a5bb8c374516ac8f7af524",
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
    # The files are format 2's: under format 2's hash they give its pinned digest, and with
    # format 2's manifest they read (sha256 verified) to the same logical tables.
    stored = [pq.read_table(t / f"{n}.parquet") for n in TABLES]
    assert table_digest(stored, 2) == FORMAT_2[name]
    tables = read_trace(t).tables
    (t / "manifest.json").write_text(json.dumps(dict(man, format_version=2,
                                                     digest=FORMAT_2[name])))
    v2 = read_trace(t)
    assert v2.manifest["format_version"] == 2
    for n in TABLES:
        assert v2.tables[n].equals(tables[n]), n


def test_two_runs_are_byte_identical(tmp_path):
    a, b = _trace(tmp_path / "a", "default"), _trace(tmp_path / "b", "default")
    for name in TABLES:
        assert (a / f"{name}.parquet").read_bytes() == (b / f"{name}.parquet").read_bytes(), name


def test_another_seed_gives_another_trace(tmp_path):
    t = _trace(tmp_path / "t", "default", seed=8)
    assert json.loads((t / "manifest.json").read_text())["digest"] != GOLDEN["default"]
