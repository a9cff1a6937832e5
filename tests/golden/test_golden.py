"""Golden traces: same scenario + seed + version => byte-identical tables and the same digest.

The pinned digests are the "process replay" of this project: a change that moves them changes
what the simulator does. If that is intended, regenerate them and say so in the commit message:
    kvsim run scenarios/NAME.toml --out /tmp/g && jq .digest /tmp/g/manifest.json

The digest is over the tables as stored, so a change of the stored format moves it too: trace
format_version 2 (delta-encoded page lists in rows.parquet) did, with every logical table (as
sim.trace.reader.read_trace returns them) equal to format 1's for both scenarios.
"""

import json
from pathlib import Path

import pytest

from sim.api import load_scenario, run
from sim.trace.schema import TABLES

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = {
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
    assert json.loads((t / "manifest.json").read_text())["digest"] == GOLDEN[name]


def test_two_runs_are_byte_identical(tmp_path):
    a, b = _trace(tmp_path / "a", "default"), _trace(tmp_path / "b", "default")
    for name in TABLES:
        assert (a / f"{name}.parquet").read_bytes() == (b / f"{name}.parquet").read_bytes(), name


def test_another_seed_gives_another_trace(tmp_path):
    t = _trace(tmp_path / "t", "default", seed=8)
    assert json.loads((t / "manifest.json").read_text())["digest"] != GOLDEN["default"]
