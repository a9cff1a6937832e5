"""The fast engine (sim/fast) against its oracle, the reference engine (sim/engine.py).

Same scenario, same seed => the same trace digest (every table, every column), the same
violations and the same summary. Scenarios come from the repository and from hypothesis, over
the whole subset `supports()` accepts: both policies, every backend and table width, plan keys,
null block, position limits, tiny pools (preemption, stalls) and chunked prefill.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sim.fast.engine as fast_engine
from sim.api import load_scenario, parse_scenario, run, switches_for
from sim.errors import ProfileError, ScenarioError
from sim.fast import supports
from sim.fuzz.strategies import fast_scenario_dicts

ROOT = Path(__file__).resolve().parents[2]


def _both(sc, tmp: Path, check: bool = False, **kw):
    out = {}
    for engine in ("fast", "reference"):
        res = run(sc, out=tmp / engine, check=check, engine=engine, **kw)
        digest = json.loads((tmp / engine / "manifest.json").read_text())["digest"]
        summary = {k: v for k, v in res.summary.items() if k != "engine"}
        out[engine] = (digest, [(v.invariant, v.step, v.request, v.message)
                                for v in res.violations], summary)
    assert out["fast"] == out["reference"]
    return out["fast"]


def _supported_scenarios() -> list[str]:
    names = []
    for p in sorted((ROOT / "scenarios").rglob("*.toml")):
        sc, _ = load_scenario(p)
        for profile in ("trtllm-post-17264", "vllm-v1-legacy", "trtllm-pre-17264"):
            try:
                _, sw = switches_for(sc, profile)
            except ProfileError:  # a combination that profile's engine does not have
                continue
            if supports(sc, sw) is None:
                names.append(f"{p.relative_to(ROOT / 'scenarios').with_suffix('')}:{profile}")
    return names


def test_only_the_vidur_workload_is_in_the_subset_today():
    """Every repository scenario uses MTP or overlap (the reference engine runs them); this
    pins that, so a scenario entering the subset gets compared below."""
    assert _supported_scenarios() == []


@pytest.mark.parametrize("profile", ["vllm-v1-legacy", "trtllm-post-17264",
                                     "trtllm-pre-17264"])
def test_vidur_workload_matches_the_reference(tmp_path, profile):
    sc, base = load_scenario(ROOT / "bench" / "workloads" / "a_vidur.toml")
    syn = sc.workload.synthetic.model_copy(update={"num_requests": 150})  # type: ignore[union-attr]
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"synthetic": syn})})
    _both(sc, tmp_path, profile=profile, base_dir=base)


def test_vidur_workload_matches_with_small_buffers(tmp_path, monkeypatch):
    """Buffers that fill every few steps, refills of a few arrivals and a token buffer that
    compacts constantly: every resume path of the compiled loop, still the same trace."""
    monkeypatch.setattr(fast_engine, "_STEPS", 8)
    monkeypatch.setattr(fast_engine, "_ARRIVALS", 3)
    monkeypatch.setattr(fast_engine, "_TOKENS", 4096)
    sc, base = load_scenario(ROOT / "bench" / "workloads" / "a_vidur.toml")
    syn = sc.workload.synthetic.model_copy(update={"num_requests": 60})  # type: ignore[union-attr]
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"synthetic": syn}),
                               "cache": sc.cache.model_copy(update={"num_blocks": 400})})
    digest, violations, summary = _both(sc, tmp_path, base_dir=base)
    assert summary["preemptions"] > 0  # the small pool really preempts
    assert violations == []


def test_checked_runs_agree_under_preemption(tmp_path):
    """The online checker fed from the fast engine's columns (through StepStream) sees what it
    sees fed records, on a pool small enough to preempt and recompute."""
    sc = parse_scenario({
        "seed": 3, "profile": "vllm-v1-legacy", "spec": {"mode": "none"},
        "overlap": {"enabled": False},
        "cache": {"tokens_per_block": 4, "num_blocks": 12, "reuse": "off"},
        "scheduler": {"policy": "max-utilization", "max_batch_size": 4},
        "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 9, "output_len": 20},
                                  {"arrival_ns": 0, "prompt_len": 7, "output_len": 16},
                                  {"arrival_ns": 4_000_000, "prompt_len": 5, "output_len": 9}]},
    })
    _, violations, summary = _both(sc, tmp_path, check=True)
    assert summary["preemptions"] > 0 and violations == []


def test_engine_fast_refuses_what_it_does_not_model():
    sc, base = load_scenario(ROOT / "scenarios" / "overlap_on.toml")
    with pytest.raises(ScenarioError, match="spec.mode is mtp"):
        run(sc, engine="fast", base_dir=base)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(d=fast_scenario_dicts(max_requests=8), data=st.data())
def test_fuzzed_scenarios_match_the_reference(tmp_path_factory, d, data):
    sc = parse_scenario(d)
    _both(sc, tmp_path_factory.mktemp("fast"), check=data.draw(st.booleans()))


@pytest.mark.parametrize("check", [True, False])  # built through records / from columns
def test_in_memory_tables_match_the_reference(check):
    """collect=True: the steps, requests and KV series tables (metrics, notebooks) are built
    from the fast engine's columns through records, under preemption."""
    sc, base = load_scenario(ROOT / "bench" / "workloads" / "a_vidur.toml")
    syn = sc.workload.synthetic.model_copy(update={"num_requests": 80})  # type: ignore[union-attr]
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"synthetic": syn}),
                               "cache": sc.cache.model_copy(update={"num_blocks": 500})})
    fast = run(sc, base_dir=base, engine="fast", check=check)
    ref = run(sc, base_dir=base, engine="reference", check=check)
    assert fast.summary["preemptions"] > 0
    assert fast.steps.equals(ref.steps)
    assert fast.requests.equals(ref.requests)
    assert fast.kv_series.equals(ref.kv_series)


def test_the_fuzzer_compiles_the_kernel_before_its_hang_guard(monkeypatch):
    """Regression (fresh-clone CI): the first numba compile ran inside the fuzzer's 0.5 s hang
    guard and was reported as a hang. evaluate() now warms the kernel first."""
    import sim.fast
    from sim.fuzz.campaign import evaluate

    monkeypatch.setattr(sim.fast, "_warm", False)
    sc = {"spec": {"mode": "none"}, "overlap": {"enabled": False},
          "cache": {"reuse": "off", "tokens_per_block": 4, "num_blocks": 16},
          "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 5, "output_len": 3}]}}
    hits, res = evaluate(sc, "vllm-v1-legacy")
    assert sim.fast._warm and hits == [] and res is not None
    assert res.summary["engine"] == "fast"


def test_warm_compiles_everything_a_run_calls():
    """Regression (fresh-clone CI): `_slices` met a strided column after warm() had compiled it
    for a contiguous one, so the next run compiled again, inside the fuzzer's hang guard; the
    alarm landed in numba's lazy type registry and every later compile in that process failed
    ("generator raised StopIteration"). After warm(), runs of every kind compile nothing."""
    import importlib
    import pkgutil

    from numba.core.registry import CPUDispatcher

    import sim
    import sim.fast

    def signatures() -> dict[str, int]:
        out = {}
        for m in pkgutil.walk_packages(sim.__path__, "sim."):
            for name, v in vars(importlib.import_module(m.name)).items():
                if isinstance(v, CPUDispatcher):
                    out[f"{m.name}.{name}"] = len(v.signatures)
        return out

    sim.fast.warm()
    before = signatures()
    sc, base = load_scenario(ROOT / "bench" / "workloads" / "a_vidur.toml")
    syn = sc.workload.synthetic.model_copy(update={"num_requests": 40})  # type: ignore[union-attr]
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"synthetic": syn})})
    with tempfile.TemporaryDirectory() as tmp:
        for check, out in [(True, None), (False, "trace"), (True, "checked")]:
            run(sc, out=None if out is None else Path(tmp) / out, check=check, base_dir=base,
                collect=False)
        ref, ref_base = load_scenario(ROOT / "scenarios" / "worked_example.toml")  # MTP, overlap
        run(ref, out=Path(tmp) / "reference", base_dir=ref_base, collect=False)
    after = signatures()
    assert {k: (before.get(k), n) for k, n in after.items() if before.get(k) != n} == {}
