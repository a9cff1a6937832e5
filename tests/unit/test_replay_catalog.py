"""Catalog faults that reach GPU memory, replayed through the CPU reference: the faulty trace is
confirmed (rows not ok where the simulator flags them), the fixed trace stays all ok."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_backend.device.pool import content
from gpu_backend.host.batch import launch_runs, stale_plan
from gpu_backend.host.events import in_flight_poison
from gpu_backend.host.layout import build_step
from gpu_backend.replay.run import run_replay
from gpu_backend.trace import load_trace
from gpu_backend.verdicts import DEFAULT_TOL

ROOT = Path(__file__).resolve().parents[2]


def _trace(tmp: Path, fault: str, faulty: bool) -> Path:
    from sim.api import load_scenario, run

    sc, base = load_scenario(ROOT / "scenarios" / "faults" / f"{fault}.toml")
    profile = f"trtllm-post-17264+{fault}" if faulty else "trtllm-post-17264"
    out = tmp / f"{fault}.{'fault' if faulty else 'fixed'}"
    run(sc, out=out, profile=profile, base_dir=base)
    return out


def _bad(trace: Path) -> dict[tuple[int, int], str]:
    res = run_replay(trace, "reference", DEFAULT_TOL)
    return {(r.step, r.request): r.verdict for r in res.rows if r.verdict != "ok"}


@pytest.mark.parametrize(("fault", "bad"), [
    ("draft_past_limit", {(4, 0): "nan", (5, 0): "nan"}),  # the I16 steps: RoPE past the table
    ("free_in_flight", {(2, 0): "nan"}),  # the I17 step: its pages refilled while in flight
    # the I14 steps: a q_len-2 plan given q_len-4 rows, refused by FlashInfer's run()
    ("plan_without_width", {(2, 0): "fault", (4, 0): "fault"}),
])
def test_memory_faults_are_confirmed_and_their_fix_is_clean(tmp_path: Path, fault: str,
                                                            bad: dict[tuple[int, int], str]
                                                            ) -> None:
    faulty = _trace(tmp_path, fault, True)
    assert {(v[1], v[2]) for v in load_trace(faulty).violations} >= set(bad)
    assert _bad(faulty) == bad
    assert _bad(_trace(tmp_path, fault, False)) == {}


def test_a_free_after_the_done_event_is_not_in_flight(tmp_path: Path) -> None:
    fixed = load_trace(_trace(tmp_path, "free_in_flight", False))
    assert in_flight_poison(fixed).before_step == {}
    faulty = load_trace(_trace(tmp_path, "free_in_flight", True))
    assert in_flight_poison(faulty).before_step == {2: [0]}


def test_rope_past_the_table_is_nan_for_k_and_q_only() -> None:
    tok, pos = torch.tensor([5, 6, 7]), torch.tensor([62, 63, 64])
    for kind in (0, 2):
        x = content(tok, pos, kind, 2, 8, torch.bfloat16, rope_rows=64)
        assert not x[:2].isnan().any() and x[2].isnan().all()
        assert torch.equal(x[:2], content(tok, pos, kind, 2, 8, torch.bfloat16)[:2])
    assert not content(tok, pos, 1, 2, 8, torch.bfloat16, rope_rows=64).isnan().any()


def test_a_plan_without_width_fails_on_flashinfers_own_check(tmp_path: Path) -> None:
    res = run_replay(_trace(tmp_path, "plan_without_width", True), "reference", DEFAULT_TOL)
    msgs = {r.message for r in res.rows if r.verdict == "fault"}
    assert msgs == {"ValueError: q implies q_len_per_req=4 but plan() used 2; re-plan with the "
                    "matching q_len_per_req. (emulated FlashInfer 0.7.2 host check)"}


def test_a_plan_cache_keyed_by_batch_never_runs_a_stale_plan(tmp_path: Path) -> None:
    # TRT-LLM #18557: eager metadata re-plans every cached wrapper in prepare(); a per-batch key
    # only adds wrappers. The trace's reused plans always have the step's own shape, so the
    # kernels see nothing: the fault is I14's cache bound (memory), not a kernel access.
    trace = load_trace(_trace(tmp_path, "plan_keyed_by_batch", True))
    assert max(s.plan_cache_size for s in trace.steps) == 5
    reused = [s for s in trace.steps if s.plan_q_len >= 0]
    assert reused
    for s in reused:
        b = build_step(s, trace.rows[s.step], trace.model.page_size, 16)
        assert all(stale_plan(b, i, e, k) is None for i, e, k in launch_runs(b))
    assert _bad(trace.path) == {}


def test_a_plan_cache_keyed_by_batch_is_confirmed_as_growth(tmp_path: Path) -> None:
    """TRT-LLM #18557's consequence is memory: the plan cache's own verdict, growth past I14's
    bound (max_draft_len 1: one plan per query width 1..2, one for prefill), confirms the
    faulty run in the agreement table; the fixed run holds one plan."""
    from gpu_backend.tools.agreement import evaluate, summary, versus_sim

    traces = [_trace(tmp_path, "plan_keyed_by_batch", f) for f in (True, False)]
    rows = evaluate(traces, ["reference"], {}, DEFAULT_TOL)
    assert [r["reference"] for r in rows] == [
        {"plan cache": "growth: 5 plans held, bound 3"}, {}]
    assert versus_sim(rows[0], "reference") == "confirmed"
    assert summary(rows, ["reference"]) == [
        "- reference: 1/1 faulty runs confirmed (a verdict not ok); 1/1 fixed runs all ok"]


def test_the_plan_cache_verdict_counts_the_wrappers_flashinfer_held() -> None:
    """FlashInfer's measured wrapper pairs decide where the replay reports them."""
    from types import SimpleNamespace

    from gpu_backend.tools.agreement import plan_cache_held
    from gpu_backend.verdicts import ReplayResult

    trace = SimpleNamespace(manifest={"model": {"tokens_per_block": 16, "num_blocks": 8,
                                                "max_draft_len": 1}},
                            steps=[SimpleNamespace(plan_cache_size=9)])
    res = ReplayResult("flashinfer", "t", DEFAULT_TOL, stats={"plan_cache_entries": 3})
    assert plan_cache_held(res, trace) is None  # type: ignore[arg-type]
    res.stats["plan_cache_entries"] = 4
    assert plan_cache_held(res, trace) == "growth: 4 plans held, bound 3"  # type: ignore[arg-type]
    assert plan_cache_held(ReplayResult("reference", "t", DEFAULT_TOL),
                           trace) == "growth: 9 plans held, bound 3"  # type: ignore[arg-type]
