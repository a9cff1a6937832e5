"""events.event_ops (arrays) against event_ops_loop (the per-event loop it replaced, the oracle):
the same pool operations, poisoned pages, touched pages, refcounts and shared blocks at every
step of traces with slot copies (partial reuse), double frees and frees in flight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from replay_traces import default_small, fault_trace

from gpu_backend.host import events
from gpu_backend.host.events import event_ops, event_ops_loop, in_flight_poison
from gpu_backend.trace import load_trace


@pytest.mark.parametrize("name", ["default40", "double_free", "free_in_flight"])
def test_event_ops_is_the_per_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         name: str) -> None:
    monkeypatch.setattr(events, "LOOP_EVENTS", 0)  # every step as arrays, however few events
    path = default_small(tmp_path) if name == "default40" else fault_trace(tmp_path, name)
    trace = load_trace(path)
    flight = in_flight_poison(trace)
    rc_fast: dict[int, int] = {}
    rc_slow: dict[int, int] = {}
    sh_fast: set[int] = set()
    sh_slow: set[int] = set()
    kinds, ever_shared = set(), False
    for s in trace.steps:
        a_fast: dict[str, np.ndarray] = {}
        a_slow: dict[str, np.ndarray] = {}
        ops, touched = event_ops(trace, s.step, 3, rc_fast, flight, a_fast, sh_fast)
        want, want_touched = event_ops_loop(trace, s.step, 3, rc_slow, flight, a_slow, sh_slow)
        assert ops == want, s.step
        assert a_fast.keys() == a_slow.keys()
        for k, v in a_slow.items():
            assert a_fast[k].tolist() == v.tolist(), (s.step, k)
        assert sorted(touched.tolist()) == sorted(want_touched)
        assert (rc_fast, sh_fast) == (rc_slow, sh_slow)
        kinds |= {op[0] for op in ops}
        ever_shared |= bool(sh_fast)
    # what each trace is here for was in it: slot copies and shared prefix blocks, a double
    # free of a live block, a free while the step that reads the block is in flight
    if name == "default40":
        assert "copy" in kinds and ever_shared
    elif name == "double_free":
        assert flight.double_free
    else:
        assert flight.before_step
    assert "nan" in kinds


@pytest.mark.parametrize("name", ["default40", "double_free", "free_in_flight"])
def test_in_flight_poison_reads_the_groups_in_any_order(tmp_path: Path, name: str) -> None:
    # the events come as their (step, phase) groups' concatenation when those are in seq order
    # (a simulator's trace), sorted by seq when not: both give what sorting them all gives
    from dataclasses import replace

    path = default_small(tmp_path) if name == "default40" else fault_trace(tmp_path, name)
    trace = load_trace(path)
    groups = list(trace.events.items())
    assert events._by_seq(trace) == sorted((e for _, g in groups for e in g),
                                           key=lambda e: e.seq)
    shuffled = replace(trace, events=dict(groups[::-1]))
    assert events._by_seq(shuffled) == events._by_seq(trace)
    assert any(e.event == "done" for _, g in groups for e in g)  # the windows are looked at
    want = in_flight_poison(trace)
    assert name == "default40" or want.before_step or want.double_free
    assert in_flight_poison(shuffled) == want
