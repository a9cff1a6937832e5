"""The loop's thread moved to the fastest CPU (gpu_backend/steer.py): real watcher threads and
real affinity changes of the test's own thread, on whatever CPUs this machine allows."""

from __future__ import annotations

import os
import time
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
    """This thread's CPUs, given back (and the watchers ended) whatever a test leaves."""
    cpus = os.sched_getaffinity(0)
    yield cpus
    steer._stop()
    os.sched_setaffinity(0, cpus)


def _figures(w: steer.Watchers) -> dict[int, float]:
    deadline = time.monotonic() + 10
    while any(t == float("inf") for t in w.took.values()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return dict(w.took)


def test_each_watcher_times_its_own_cpu_and_ends(own: set[int]) -> None:
    w = steer.watchers(sorted(own))
    assert steer.watchers(sorted(own)) is w  # one set a process
    took = _figures(w)
    assert set(took) == own and all(0 < t < 1 for t in took.values())
    assert os.sched_getaffinity(0) == own  # the watchers moved, not this thread
    steer._stop()
    assert not any(t.is_alive() for t in w.threads)


def test_a_tick_moves_to_the_quickest_only_when_slow_where_it_is(
        own: set[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    monkeypatch.setattr(steer, "LOOK", 0.0)
    s = steer.Steer()
    assert s.watch is not None
    _figures(s.watch)
    cpus = sorted(own)
    fake = dict.fromkeys(cpus, 100e-6)
    fake[cpus[-1]] = 50e-6
    monkeypatch.setattr(s.watch, "took", fake)  # the watchers' figures, as they might be
    s.tick()  # not pinned yet: to the quickest
    assert (s.here, s.moves) == (cpus[-1], 1) and os.sched_getaffinity(0) == {cpus[-1]}
    s.tick()
    assert s.moves == 1  # its own is the quickest: stays
    if len(cpus) > 1:
        fake[cpus[-1]] = 2 * fake[cpus[0]]  # a slow spell where it is: moves
        s.tick()
        assert (s.here, s.moves) == (cpus[0], 2) and os.sched_getaffinity(0) == {cpus[0]}
        fake[cpus[-1]] = 1.2 * fake[cpus[0]]  # the other a little quicker: not worth a move
        s.tick()
        assert s.moves == 2
    s.close()
    assert os.sched_getaffinity(0) == own and s.stats()["steer_looks"] >= 2


def test_too_few_cpus_or_disabled_moves_nothing(own: set[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steer, "MIN_CPUS", len(own) + 1)
    for s in (steer.Steer(), steer.Steer(enabled=False)):
        s.tick()
        s.close()
        assert s.watch is None and s.stats() == {"steer_moves": 0, "steer_looks": 0}
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    monkeypatch.setattr(steer, "ENABLED", False)  # the switch `bench/gpu_pair.py --set` turns
    s = steer.Steer()
    s.tick()
    assert s.watch is None and os.sched_getaffinity(0) == own
    assert steer._WATCHERS is None  # no threads started


def test_a_steered_replay_has_the_same_verdicts_and_gives_the_cpus_back(
        tmp_path: Path, own: set[int], monkeypatch: pytest.MonkeyPatch) -> None:
    trace = load_trace(named_trace(tmp_path, "big", 12))
    m = trace.model

    def run() -> Any:
        return replay(trace, ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu")

    plain = run()
    assert plain.stats["steer_looks"] == 0  # the CPU backend: its torch needs every core
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    monkeypatch.setattr(steer, "LOOK", 0.0)  # a look after each step
    monkeypatch.setattr(steer, "SLOW", 0.0)  # ... and a move at each, once there are figures
    monkeypatch.setattr(driver, "Steer", lambda _cuda: steer.Steer(True))
    _figures(steer.watchers(sorted(own)))
    steered = run()
    steps = len([s for s in trace.steps if trace.rows[s.step]])
    assert steered.stats["steer_looks"] == steered.stats["steer_moves"] == steps
    assert [(r.step, r.row, r.verdict, r.err) for r in steered.rows] == \
        [(r.step, r.row, r.verdict, r.err) for r in plain.rows]
    assert os.sched_getaffinity(0) == own
