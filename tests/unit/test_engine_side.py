"""Invariants judged by the engine itself (they need host-side state the trace does not carry):
I18 reservation arithmetic after processing, I19 admission headroom, LIVENESS."""

from pathlib import Path

from sim.api import load_scenario, parse_scenario, run
from sim.engine import Engine
from sim.profiles import resolve_profile
from sim.workload import iter_workload

ROOT = Path(__file__).resolve().parents[2]


def _engine(name: str = "worked_example") -> Engine:
    import numpy as np

    sc, base = load_scenario(ROOT / "scenarios" / f"{name}.toml")
    specs = iter_workload(sc.workload, np.random.default_rng(0), tokens_per_block=32,
                          base_dir=base)
    return Engine(sc, resolve_profile(sc.profile), specs, lambda *a: None)


def test_i18_fires_when_the_reservation_drifts_from_n_minus_1():
    eng = _engine()
    eng.run()
    r = eng.proc
    from sim.request import Request
    req = Request(9, 0, 4, 4, __import__("numpy").zeros(16, "int32"), n_host=10)
    eng.kv.reserved[9] = 12  # N-1 = 9, nothing in flight: must be 9
    r._check_i18(req, 7)
    assert r.violations[-1].message == ("I18 step 7 req 9: after processing, reserved C=12 but "
                                        "N-1=9 with no step in flight")


def test_i19_fires_on_admission_without_headroom_and_not_with_it():
    sc, base = load_scenario(ROOT / "scenarios" / "faults" / "gne_without_headroom.toml")
    bad = run(sc, profile="trtllm-post-17264+gne_without_headroom", base_dir=base)
    assert bad.violations[0].message == (
        "I19 step 0 req 0: guaranteed-no-evict admitted with 5 blocks to completion, but "
        "spec/overlap headroom of 6 slots needs 6")
    assert run(sc, base_dir=base).violations == []


def test_liveness_fires_when_waiting_requests_can_never_be_scheduled():
    eng = _engine()
    eng._arrive(0)  # the request is waiting; the engine is asked to go on with nothing to run
    eng.proc.stalled(3)
    assert eng.proc.violations[-1].invariant == "LIVENESS"
    assert eng.proc.violations[-1].message.startswith("LIVENESS step 3 req 0: requests are "
                                                       "waiting, nothing runs or is in flight")


def test_a_request_that_can_never_fit_is_rejected_not_stalled():
    d = {"cache": {"tokens_per_block": 4, "num_blocks": 3},
         "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 40, "output_len": 2},
                                   {"arrival_ns": 0, "prompt_len": 4, "output_len": 2}]}}
    res = run(parse_scenario(d))
    assert res.violations == []
    assert (res.summary["rejected"], res.summary["finished"]) == (1, 1)
