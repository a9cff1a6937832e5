"""The hand-built traces through real FlashInfer kernels: the verdicts the CPU reference gives."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from replay_traces import EXPECTED, SCENARIOS, Builder, _two

from gpu_backend.replay.run import replay_isolated, run_replay
from gpu_backend.verdicts import DEFAULT_TOL

pytestmark = pytest.mark.gpu


def _bad(res: object) -> dict[tuple[int, int], str]:
    return {(r.step, r.request): r.verdict for r in res.rows if r.verdict != "ok"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_flashinfer_verdicts(tmp_path: Path, name: str) -> None:
    trace = SCENARIOS[name](tmp_path / name)
    gpu = run_replay(trace, "flashinfer", DEFAULT_TOL)
    assert _bad(gpu) == EXPECTED[name]
    assert _bad(run_replay(trace, "reference", DEFAULT_TOL)) == _bad(gpu)


@pytest.mark.parametrize(("name", "made"), [("clean_mtp", set()), ("clean_decode", {"decode"}),
                                           ("clean_mtp_xqa", {"xqa_ws"})])
def test_the_decode_wrapper_and_xqa_workspace_are_made_on_first_use(tmp_path: Path, name: str,
                                                                    made: set[str]) -> None:
    """A replay of prompts and verify rows makes neither (each replay made both before its
    first launch); the traces that use one get it, with the verdicts of the CPU reference."""
    from gpu_backend.replay.flashinfer import FlashInferKernels
    from gpu_backend.replay.loop import replay
    from gpu_backend.trace import load_trace

    trace = load_trace(SCENARIOS[name](tmp_path / name))
    k = FlashInferKernels(trace.model.num_q_heads, "cuda")
    res = replay(trace, k, "cuda")
    assert {"decode", "xqa_ws"} & set(vars(k)) == made
    assert _bad(res) == EXPECTED[name]
    if made == {"xqa_ws"}:
        assert k.xqa_ws.shape == k.ws[0].shape


def test_clean_rows_stay_well_inside_tolerance(tmp_path: Path) -> None:
    gpu = run_replay(SCENARIOS["clean_mtp"](tmp_path / "t"), "flashinfer", DEFAULT_TOL)
    assert max(r.err for r in gpu.rows) < DEFAULT_TOL / 2


@pytest.mark.parametrize(("plan_q_len", "says"), [
    (1, "non-tensor-core decode kernel only supports q_len_per_req=1"),
    (2, "q implies q_len_per_req=4 but plan() used 2"),
])
def test_stale_plan_for_another_width_is_refused_by_flashinfer(tmp_path: Path, plan_q_len: int,
                                                               says: str) -> None:
    b = _two(29, 45)
    b.step([b.gen(0, 3, 1), b.gen(1, 3, 2)], plan_q_len=plan_q_len, plan_batch=2)
    trace = b.write(tmp_path / "t", "stale_plan")
    res = run_replay(trace, "flashinfer", DEFAULT_TOL)
    assert _bad(res) == {(1, 0): "fault", (1, 1): "fault"}
    assert says in res.rows[2].message
    assert _bad(run_replay(trace, "reference", DEFAULT_TOL)) == _bad(res)


def test_rows_a_stale_plan_does_not_cover_read_as_nan(tmp_path: Path) -> None:
    # A CUDA-core plan for 2 requests given 3 query rows: run() infers width 3 // 2 = 1 and
    # launches the plan's grid, which writes the first two rows only; the output buffer starts
    # as NaN, so the third row is a `nan` verdict instead of whatever memory held.
    b = _two(29, 45)
    b.request(2, list(range(300, 333)))
    b.step([b.ctx(2)])
    b.step([b.gen(0, 0, 0), b.gen(1, 0, 0), b.gen(2, 0, 0)], plan_q_len=1, plan_batch=2)
    res = run_replay(b.write(tmp_path / "t", "short_plan"), "flashinfer", DEFAULT_TOL)
    assert _bad(res).get((2, 2)) == "nan"


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
