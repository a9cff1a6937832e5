"""How checked runs use the compiled checker (sim/check/compiled) and StepChecker, its oracle.

Both engines' output goes to the compiled checker (the fast engine's chunks, the reference
engine's records in batches); only a run it finds violations in is run again through
StepChecker for the worded messages, and the two must agree (a disagreement is a kvsim bug,
raised as CheckerDisagreement: an error under pytest). `kvsim check` screens a trace
the same way. The equality of the two checkers itself is tests/unit/test_check_compiled.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import sim.api
from sim.api import CheckerDisagreement, load_scenario, parse_scenario, run
from sim.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _scenario(plan_key: str):
    """A fast-engine scenario whose batch grows 1 -> 4: keyed by batch size, the plan cache
    grows past its bound (I14, TRT-LLM #18557) without MTP."""
    return parse_scenario({
        "seed": 5, "profile": "trtllm-post-17264", "spec": {"mode": "none"},
        "overlap": {"enabled": False},
        "cache": {"tokens_per_block": 4, "num_blocks": 64, "reuse": "off"},
        "switches": {"backend": "fa3", "plan_key": plan_key},
        "workload": {"requests": [{"arrival_ns": t * 2_000_000, "prompt_len": 9,
                                   "output_len": 24} for t in range(4)]},
    })


@pytest.fixture
def reruns(monkeypatch):
    calls: list[int] = []
    worded = sim.api._worded

    def counting(*a, **kw):
        calls.append(1)
        return worded(*a, **kw)

    monkeypatch.setattr(sim.api, "_worded", counting)
    return calls


@pytest.mark.parametrize("engine", ["fast", "reference"])
def test_a_clean_run_is_checked_once_and_never_rerun(reruns, engine):
    res = run(_scenario("fresh"), check=True, engine=engine)
    assert res.summary["engine"] == engine and res.violations == [] and reruns == []


def test_a_violating_run_is_worded_by_stepchecker_as_the_reference_engine_words_it(reruns):
    sc = _scenario("per-batch")
    fast = run(sc, check=True, engine="fast")
    ref = run(sc, check=True, engine="reference")
    assert len(reruns) == 2  # each engine: found by the compiled checker, worded by StepChecker
    assert {v.invariant for v in fast.violations} == {"I14"}
    assert [(v.invariant, v.step, v.request, v.message) for v in fast.violations] == [
        (v.invariant, v.step, v.request, v.message) for v in ref.violations]


def test_a_disagreement_is_reported_and_stepchecker_wins(monkeypatch):
    from sim.check.compiled import CompiledChecker

    monkeypatch.setattr(CompiledChecker, "finish", lambda self: [("I1", 0, 0)])
    with pytest.warns(CheckerDisagreement, match="compiled checker found"):
        res = run(_scenario("per-batch"), check=True, engine="fast")
    assert res.violations and ("I1", 0, 0) not in [(v.invariant, v.step, v.request)
                                                   for v in res.violations]


def _check(*argv: str):
    r = CliRunner().invoke(app, ["check", *argv, "--json"])
    return r.exit_code, json.loads(r.output)["violations"]


def test_kvsim_check_screens_with_the_compiled_checker(tmp_path, monkeypatch):
    run(_scenario("fresh"), out=tmp_path / "clean", check=False, engine="fast")
    run(_scenario("per-batch"), out=tmp_path / "bad", check=False, engine="fast")
    screened = _check(str(tmp_path / "bad"))
    assert screened[0] == 1 and screened == _check(str(tmp_path / "bad"), "--reference")

    def stepchecker_must_not_run(path):
        raise AssertionError("StepChecker ran on a clean trace")

    monkeypatch.setattr("sim.check.offline.check_trace", stepchecker_must_not_run)
    assert _check(str(tmp_path / "clean")) == (0, [])


FAULTS = sorted((ROOT / "scenarios" / "faults").glob("*.toml"))


@pytest.mark.parametrize("path", FAULTS, ids=[p.stem for p in FAULTS])
def test_reference_records_checked_in_batches_of_any_size(monkeypatch, path):
    """The reference engine's records reach the compiled checker in batches of _CHECK_BATCH
    rows: batches of a few rows cut steps' events apart from their launch; every catalog fault
    must still be found, as StepChecker finds it (a disagreement is an error here)."""
    sc, base = load_scenario(path)
    profile = f"{sc.profile}+{path.stem}"
    whole = run(sc, profile=profile, base_dir=base, engine="reference")
    monkeypatch.setattr(sim.api, "_CHECK_BATCH", 3)
    small = run(sc, profile=profile, base_dir=base, engine="reference")
    assert small.violations and small.violations == whole.violations
