"""The loop's thread on the fastest CPUs (gpu_backend/steer.py): real affinity changes of the
test's own thread, on whatever CPUs this machine allows."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from replay_traces import named_trace

from gpu_backend import driver, steer
from gpu_backend.driver import replay
from gpu_backend.reference import ReferenceKernels
from gpu_backend.tracedata import load_trace

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="no CPU affinity on this OS")


@pytest.fixture
def own() -> Any:
    """This thread's CPUs, given back whatever a test leaves."""
    cpus = os.sched_getaffinity(0)
    yield cpus
    os.sched_setaffinity(0, cpus)


def test_speeds_times_every_cpu_on_that_cpu(own: set[int]) -> None:
    took = steer.speeds(sorted(own))
    assert set(took) == own and all(t > 0 for t in took.values())
    assert os.sched_getaffinity(0) == {max(own)}  # left on the last: the caller pins it


def test_a_sweep_keeps_the_thread_to_the_fastest_and_close_gives_all_back(
        own: set[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    monkeypatch.setattr(steer, "FASTEST", 1)
    monkeypatch.setattr(steer, "PERIOD", 3600.0)
    monkeypatch.setattr(steer, "_QUICKEST", [float("inf")])  # a process that never looked
    s = steer.Steer()
    timed: list[dict[int, float]] = []
    speeds = steer.speeds
    monkeypatch.setattr(steer, "speeds", lambda cpus: timed.append(speeds(cpus)) or timed[-1])
    s.tick()  # the first look sweeps: nothing to compare with yet
    fastest = min(timed[0], key=timed[0].__getitem__)
    assert os.sched_getaffinity(0) == {fastest} and s.kept == [fastest]
    assert steer._QUICKEST[0] == min(timed[0].values())
    s.tick()  # not due for an hour: no look
    assert len(timed) == 1 and s.stats()["steer_sweeps"] == 1 and s.looks == 1
    s.close()
    assert os.sched_getaffinity(0) == own


def test_a_look_sweeps_only_where_the_thread_is_slow(own: set[int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    monkeypatch.setattr(steer, "PERIOD", 0.0)
    monkeypatch.setattr(steer, "_QUICKEST", [40e-6])
    probe = [38e-6]
    monkeypatch.setattr(steer, "_timed", lambda: probe[0])
    s = steer.Steer()
    s.tick()  # 38 µs against 40: fast where it is, no sweep, the quickest now 38
    assert (s.looks, s.sweeps, steer._QUICKEST[0]) == (1, 0, 38e-6)
    assert os.sched_getaffinity(0) == own
    probe[0] = 1.2 * 38e-6  # under SLOW x the quickest
    s.tick()
    assert s.sweeps == 0
    probe[0] = 2 * 38e-6  # a slow spell here: a sweep, the thread then on FASTEST CPUs
    s.tick()
    assert s.sweeps == 1 and os.sched_getaffinity(0) == set(s.kept)
    assert len(s.kept) == min(steer.FASTEST, len(own))
    s.close()
    assert os.sched_getaffinity(0) == own


def test_too_few_cpus_or_disabled_moves_nothing(own: set[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steer, "MIN_CPUS", len(own) + 1)
    for s in (steer.Steer(), steer.Steer(enabled=False)):
        s.tick()
        s.close()
        assert s.stats() == {"steer_sweeps": 0, "steer_looks": 0, "steer_s": 0.0,
                             "steer_cpus": []}
        assert os.sched_getaffinity(0) == own
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    monkeypatch.setattr(steer, "ENABLED", False)  # the switch `bench/gpu_pair.py --set` turns
    s = steer.Steer()
    s.tick()
    assert s.sweeps == 0 and os.sched_getaffinity(0) == own


def test_a_steered_replay_has_the_same_verdicts_and_gives_the_cpus_back(
        tmp_path: Path, own: set[int], monkeypatch: pytest.MonkeyPatch) -> None:
    trace = load_trace(named_trace(tmp_path, "big", 12))
    m = trace.model

    def run() -> Any:
        return replay(trace, ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu")

    plain = run()
    assert plain.stats["steer_sweeps"] == 0  # the CPU backend: its torch needs every core
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    monkeypatch.setattr(steer, "FASTEST", 1)
    monkeypatch.setattr(steer, "PERIOD", 0.0)  # a look after each step
    monkeypatch.setattr(steer, "SLOW", 0.0)  # ... and every look sweeps
    monkeypatch.setattr(driver, "Steer", lambda _cuda: steer.Steer(True))
    steered = run()
    looks = len([s for s in trace.steps if trace.rows[s.step]])
    assert steered.stats["steer_looks"] == steered.stats["steer_sweeps"] == looks
    assert [(r.step, r.row, r.verdict, r.err) for r in steered.rows] == \
        [(r.step, r.row, r.verdict, r.err) for r in plain.rows]
    assert os.sched_getaffinity(0) == own
