"""Replays every shrunk failure kept under tests/regressions/*.toml: each must now run clean
under the fixed profile its file names (`profile = ...`). Files in pending/ are bugs not fixed
yet; they move up here (with their fix) once they run clean."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.api import load_scenario, run

HERE = Path(__file__).resolve().parent
CASES = sorted(HERE.glob("*.toml"))


def test_there_are_regressions() -> None:
    assert CASES, "tests/regressions/ has no scenarios: the replay below would test nothing"


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_regression_runs_clean(path: Path) -> None:
    sc, base = load_scenario(path)
    fixed = ("trtllm-post-17264", "vllm-v1-legacy")
    assert sc.profile in fixed, "regressions run under a fixed profile"
    res = run(sc, base_dir=base)
    assert not res.violations, "\n".join(v.message for v in res.violations[:5])
