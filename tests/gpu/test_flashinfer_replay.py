"""The hand-built traces through real FlashInfer kernels: the verdicts the CPU reference gives."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from replay_traces import EXPECTED, SCENARIOS, Builder, _two

from gpu_backend.isolate import replay_isolated
from gpu_backend.oracle import DEFAULT_TOL
from gpu_backend.run import run_replay

pytestmark = pytest.mark.gpu


def _bad(res: object) -> dict[tuple[int, int], str]:
    return {(r.step, r.request): r.verdict for r in res.rows if r.verdict != "ok"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_flashinfer_verdicts(tmp_path: Path, name: str) -> None:
    trace = SCENARIOS[name](tmp_path / name)
    gpu = run_replay(trace, "flashinfer", DEFAULT_TOL)
    assert _bad(gpu) == EXPECTED[name]
    assert _bad(run_replay(trace, "reference", DEFAULT_TOL)) == _bad(gpu)


def test_clean_rows_stay_well_inside_tolerance(tmp_path: Path) -> None:
    gpu = run_replay(SCENARIOS["clean_mtp"](tmp_path / "t"), "flashinfer", DEFAULT_TOL)
    assert max(r.err for r in gpu.rows) < DEFAULT_TOL / 2


def test_stale_plan_for_another_width_is_not_ok(tmp_path: Path) -> None:
    b = _two(29, 45)
    b.step([b.gen(0, 3, 1), b.gen(1, 3, 2)], plan_q_len=1, plan_batch=2)
    res = run_replay(b.write(tmp_path / "t", "stale_plan"), "flashinfer", DEFAULT_TOL)
    assert {r.verdict for r in res.rows if r.step == 1} != {"ok"}


def _wild(out: Path) -> Path:
    b: Builder = _two(29, 45)
    b.step([b.gen(0, 0, 0), b.gen(1, 0, 0)])
    r0 = b.gen(0, 0, 0)
    b.step([replace(r0, pages=(10_000_000,) + r0.pages[1:]), b.gen(1, 0, 0)])
    b.step([b.gen(0, 0, 0), b.gen(1, 0, 0)])
    return b.write(out, "wild_page")


@pytest.mark.skipif(sys.platform != "linux", reason="child processes with CUDA")
def test_isolate_pins_a_wild_page_on_its_step_and_carries_on(tmp_path: Path) -> None:
    res = replay_isolated(_wild(tmp_path / "t"), "flashinfer", DEFAULT_TOL)
    by_step = {(r.step, r.request): r for r in res.rows}
    assert by_step[(2, 0)].verdict in ("fault", "nan", "mismatch", "corrupt")
    assert len(res.rows) == 8  # every step after the fault still has a verdict
    assert by_step[(1, 0)].verdict == "ok"
