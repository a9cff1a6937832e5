"""gpu_backend/host/prepare_jit.py: the usual generation step's block events in one compiled pass
give
what `events.event_ops` and `events.join_rewind` give (its oracle) on every step of the replay
test traces it takes: the same pool operations, poisoned rows, touched pages and shared blocks
after; a step it does not take is left as it was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from replay_traces import FAULTS, SCENARIOS, named_trace

from gpu_backend.host import events, prepare, prepare_jit
from gpu_backend.host.graph_block import H200, Planner
from gpu_backend.host.prepare import HostState
from gpu_backend.host.staging import Chunk
from gpu_backend.host.truth import truth_shape
from gpu_backend.replay.loop import GUARD_PAGES
from gpu_backend.trace import EVENT_CODES, TraceData, load_trace

NAMES = ["default40", "big", *sorted(SCENARIOS), *FAULTS]


def _state(trace: TraceData) -> HostState:
    slots, _, last = truth_shape(trace)
    return HostState(trace, GUARD_PAGES, trace.model.max_position, last=last,
                     free=list(range(slots))[::-1], graphs=Planner.for_model(trace.model, H200))


@pytest.mark.parametrize("name", NAMES)
def test_every_step_it_takes_gets_the_oracles_operations(tmp_path: Path, name: str,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    trace = load_trace(named_trace(tmp_path, name, 9))
    st = _state(trace)
    flight = events.in_flight_poison(trace)
    took = 0
    for s in prepare.replayed(trace):
        before = set(st.shared)
        if st.prev_step >= 0 and not flight.double_free:
            want: dict[str, np.ndarray] = {}
            with pytest.MonkeyPatch.context() as m:  # the oracle: `event_ops`, `join_rewind`
                m.setattr(prepare_jit, "pool_ops", lambda *a: None)
                ops, touched = events.step_ops(st, s, flight, want)
            shared, st.shared = st.shared, set(before)
            got: dict[str, np.ndarray] = {}
            quick = prepare_jit.pool_ops(trace, s.step, st.guard,
                                         flight.before_step.get(s.step, []),
                                     st.shared, st.rewind, got)
            if quick is None:
                assert not got and st.shared == before
            else:
                took += 1
                assert quick[0] == ops and st.shared == shared
                assert quick[1].dtype == touched.dtype and np.array_equal(quick[1], touched)
                assert list(got) == list(want)
                assert all(got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k])
                           for k in want)
            st.shared = before
        prepare.prepare_step(st, s, trace.rows[s.step], flight, Chunk("cpu"))
    if name == "big":
        assert took == len(prepare.replayed(trace)) - 1  # every generation step


def test_a_copy_or_a_shared_block_is_left_to_the_oracle(tmp_path: Path) -> None:
    """A step whose events copy a slot, or leave a block shared, is not taken: nothing in the
    arrays, the shared blocks as they were."""
    trace = load_trace(named_trace(tmp_path, "big", 3))
    step = prepare.replayed(trace)[1].step
    key = (step, "sched")
    c = trace.event_columns[key]
    codes = ("copy", "alloc")
    for i, (field, value) in enumerate((("src", 0), ("refcount", 2))):
        edited = dict(trace.event_columns)
        col = getattr(c, field).copy()
        col[0] = value
        code = c.code.copy()
        code[0] = EVENT_CODES.index(codes[i])
        edited[key] = type(c)(**{**vars(c), field: col, "code": code})
        t = type(trace)(**{**vars(trace), "event_columns": edited})
        arrays: dict[str, np.ndarray] = {}
        shared = {1, 2}
        assert prepare_jit.pool_ops(t, step, GUARD_PAGES, [], shared, None, arrays) is None
        assert not arrays and shared == {1, 2}
