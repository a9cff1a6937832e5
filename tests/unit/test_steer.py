"""`gpu_backend.steer`: the probe threads answer from their own CPUs, a slow look sweeps and
keeps the loop's thread to the quickest CPUs, a quick one leaves it, `close` gives every CPU
back, and a replay on the CPU backend never looks."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from replay_traces import SCENARIOS

from gpu_backend import steer
from gpu_backend.oracle import DEFAULT_TOL
from gpu_backend.run import run_replay

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="no CPU affinity on this OS")


@pytest.fixture
def own() -> Iterator[list[int]]:
    """The test thread's CPUs, given back after the test whatever it did; the quickest probe
    seen put back too."""
    cpus, quickest = os.sched_getaffinity(0), steer._QUICKEST[0]
    yield sorted(cpus)
    os.sched_setaffinity(0, cpus)
    steer._QUICKEST[0] = quickest


def test_a_sweep_times_every_cpu_from_a_thread_pinned_there(own: list[int],
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    where: dict[int, set[int]] = {}
    timed = steer._timed

    def spy() -> float:  # the probe thread's CPUs, as it probes
        where[int(threading.current_thread().name.rsplit("-", 1)[1])] = \
            os.sched_getaffinity(0)
        return timed()

    p = steer.Probes(own)
    monkeypatch.setattr(steer, "_timed", spy)
    took, again = p.sweep(), p.sweep()
    assert sorted(took) == own == sorted(again)
    assert all(0 < t < steer.WAIT for t in [*took.values(), *again.values()])
    assert where == {c: {c} for c in own}


def test_a_slow_look_sweeps_and_keeps_the_thread_to_the_quickest(
        own: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    monkeypatch.setattr(steer, "FASTEST", 1)
    steer._QUICKEST[0] = 1e-12  # every look is slow next to it
    s = steer.Steer()
    s.tick()
    assert (s.looks, s.sweeps) == (1, 1) and s.stats()["steer_cpus"] == s.kept
    assert len(s.kept) == 1 and s.kept[0] in own
    assert os.sched_getaffinity(0) == set(s.kept)
    assert steer._QUICKEST[0] == 1e-12  # no probe is quicker
    s.tick()  # within PERIOD of the last look: nothing
    assert s.looks == 1
    s.close()
    assert os.sched_getaffinity(0) == set(own)
    s.tick()  # closed: no look
    assert s.looks == 1


def test_a_quick_look_leaves_the_thread_where_it_is(own: list[int],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    steer._QUICKEST[0] = 1e9
    s = steer.Steer()
    s.tick()
    assert (s.looks, s.sweeps, s.kept) == (1, 0, [])
    assert steer._QUICKEST[0] < 1  # the look's own time is the quickest seen now
    s.close()
    assert os.sched_getaffinity(0) == set(own)


def test_off_below_min_cpus_or_when_asked(own: list[int],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    steer._QUICKEST[0] = 1e-12  # a look would sweep
    monkeypatch.setattr(steer, "MIN_CPUS", len(own) + 1)
    off = [steer.Steer(), steer.Steer(enabled=False)]
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    off.append(steer.Steer(enabled=False))
    monkeypatch.setattr(steer, "ENABLED", False)  # KVSIM_STEER=0
    off.append(steer.Steer())
    for s in off:
        s.tick()
        assert (s.looks, s.sweeps, s.cpus) == (0, 0, [])
    assert os.sched_getaffinity(0) == set(own)


def test_a_replay_on_the_cpu_never_looks(own: list[int], monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.setattr(steer, "MIN_CPUS", 1)
    steer._QUICKEST[0] = 1e-12
    res = run_replay(SCENARIOS["clean_mtp"](tmp_path / "t"), "reference", DEFAULT_TOL)
    assert (res.stats["steer_looks"], res.stats["steer_sweeps"]) == (0, 0)
    assert os.sched_getaffinity(0) == set(own)
