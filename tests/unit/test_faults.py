"""The fault catalog: each fault fires its invariant first, at a pinned step; fixed is clean."""

from pathlib import Path

import pytest

from sim.api import load_scenario, run
from sim.profiles import FAULTS

ROOT = Path(__file__).resolve().parents[2]
FIRST_STEP = {
    "uncorrected_overlap": 2, "first_gen_host_estimate": 1, "logical_width_table": 3,
    "reserved_table_fa2": 1, "plan_without_width": 2, "plan_keyed_by_batch": 8,
    "draft_past_limit": 4, "device_ahead_overrun": 1,
    "free_in_flight": 2, "double_free": 2, "append_into_shared": 9,
    "stale_graph_pages": 3,
}


def _run(name: str, profile: str):  # type: ignore[no-untyped-def]
    sc, base = load_scenario(ROOT / "scenarios" / "faults" / f"{name}.toml")
    return run(sc, profile=profile, base_dir=base)


def test_every_fault_has_a_scenario_and_a_pinned_step():
    assert set(FIRST_STEP) == set(FAULTS)
    for name in FAULTS:
        assert (ROOT / "scenarios" / "faults" / f"{name}.toml").exists()


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_on_fires_its_invariant_first(name):
    res = _run(name, f"trtllm-post-17264+{name}")
    assert res.violations, f"{name}: no invariant fired"
    first = res.violations[0]
    assert (first.invariant, first.step) == (FAULTS[name].invariant, FIRST_STEP[name]), first


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_off_same_scenario_is_clean(name):
    res = _run(name, "trtllm-post-17264")
    assert res.violations == []


def test_worked_example_fires_i12_at_the_first_generation_step_before_the_fix():
    sc, base = load_scenario(ROOT / "scenarios" / "worked_example.toml")
    pre = run(sc, profile="trtllm-pre-17264", base_dir=base)
    i12 = [v for v in pre.violations if v.invariant == "I12"]
    assert i12[0].message == ("I12 step 1 req 0: host page-table row needs 3 blocks "
                              "(kv_len_host 65, B=32) but 2 are allocated")
    assert run(sc, profile="trtllm-post-17264", base_dir=base).violations == []
