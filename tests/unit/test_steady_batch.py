"""gpu_backend/host/prepare.py: a steady step's layout and graph block in one compiled call give
`layout.build_step`'s batch, field for field, and `steady_jit.packed`'s block on it, word for
word, on every step of the replay test traces it takes; a step it cannot pack is left with
nothing staged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from replay_traces import FAULTS, SCENARIOS, named_trace

from gpu_backend.host import events, prepare, steady_jit, truth
from gpu_backend.host.batch import _FIELDS, Columns, StepBatch
from gpu_backend.host.graph_block import H200, Planner
from gpu_backend.host.layout import build_step
from gpu_backend.host.prepare import HostState
from gpu_backend.host.staging import Chunk
from gpu_backend.host.truth import truth_shape
from gpu_backend.replay.loop import GUARD_PAGES
from gpu_backend.trace import TraceData, load_trace

NAMES = ["default40", "big", *sorted(SCENARIOS), *FAULTS]


def _state(trace: TraceData) -> HostState:
    slots, _, last = truth_shape(trace)
    return HostState(trace, GUARD_PAGES, trace.model.max_position, last=last,
                     free=list(range(slots))[::-1], graphs=Planner.for_model(trace.model, H200))


def _same_batch(a: StepBatch, b: StepBatch) -> None:
    assert list(vars(a)) == list(vars(b)) == list(_FIELDS)
    for k in _FIELDS:
        x, y = getattr(a, k), getattr(b, k)
        if isinstance(y, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), k
        else:
            assert x == y, k


def _take(st: HostState, s: Any, c: Columns, flight: Any, chunk: Chunk) -> tuple[Any, ...]:
    """`prepare.take` on step s as `prepare` calls it (its events applied first)."""
    arrays: dict[str, np.ndarray] = {}
    ops, touched = events.step_ops(st, s, flight, arrays)
    slots, fill = truth.admit_rows(st, c["request"], c["committed"], {})
    shared = np.fromiter(st.shared, np.int64, len(st.shared))
    args = (st.graph_caps, s, c, shared, st.trace.model.page_size, st.guard, slots, arrays,
            ops, touched, st.prev_step, st.graphs, st.trace.model.num_blocks + 2 * st.guard,
            st.rope_rows, chunk)
    return prepare.take(*args), shared, (slots, arrays, ops, touched), fill


@pytest.mark.parametrize("name", NAMES)
def test_the_one_call_gives_build_steps_batch_and_packeds_block(tmp_path: Path,
                                                                name: str) -> None:
    """Each step `may` takes, in a fresh chunk: the batch `build_step` makes of it, and, when
    it packs it, the block (words, key, targets, group) `steady_jit.packed` makes on that batch,
    from the same host state; when it does not, nothing staged and no capacity grown."""
    trace = load_trace(named_trace(tmp_path, name, 9))
    st, twin = _state(trace), _state(trace)
    flight = events.in_flight_poison(trace)
    took = 0
    for s in prepare.replayed(trace):
        c = trace.columns.get(s.step)
        if st.prev_step >= 0 and prepare.may(s, c, s.step in trace.checked):
            assert c is not None
            caps = dict(st.graph_caps)
            chunk, again = Chunk("cpu"), Chunk("cpu")
            got, shared, (slots, arrays, ops, touched), fill = _take(st, s, c, flight, chunk)
            if got is not None and not fill:
                took += 1
                b = build_step(s, trace.rows[s.step], trace.model.page_size, st.guard, shared,
                               c, checked=True)
                _same_batch(got[0], b)
                want = steady_jit.packed(caps, b, slots, arrays, ops, touched, st.prev_step,
                                        st.graphs, trace.model.num_blocks + 2 * st.guard,
                                        st.rope_rows, again)
                if got[1] is None:
                    assert want is None and chunk.n == 0 and caps == st.graph_caps
                else:
                    assert steady_jit.steady(b)  # the shape `prepare.may` and the call check
                    assert want is not None and np.array_equal(chunk.words(), again.words())
                    assert got[1][0] == want[0] and dict(got[1][1].slots) == \
                        dict(want[1].slots)
                    assert all(np.array_equal(x, y) for x, y in zip(got[1][2], want[2],
                                                                    strict=True))
                    assert got[1][3] == want[3]
        # both states on to the next step the replay's way
        prepare.prepare_step(twin, s, trace.rows[s.step], flight, Chunk("cpu"))
        st = twin
        twin = _copy(twin)
    if name == "big":
        assert took == len(prepare.replayed(trace)) - 1  # every generation step


def _copy(st: HostState) -> HostState:
    """A copy of the host state that `prepare_step` on it leaves the original's as it was."""
    out = HostState(st.trace, st.guard, st.rope_rows, set(st.shared), dict(st.slot),
                    list(st.free), dict(st.last), st.ends, st.held, graphs=st.graphs,
                    graph_caps=dict(st.graph_caps), prev_step=st.prev_step)
    out.rewind = st.rewind
    return out


def test_a_step_of_mixed_widths_is_laid_out_and_not_packed(tmp_path: Path) -> None:
    """A generation step whose last row has one query less (and one append less) is laid out
    as `build_step` lays it out, and is no graph step for the call: nothing staged, no
    capacity grown."""
    trace = load_trace(named_trace(tmp_path, "big", 3))
    st = _state(trace)
    flight = events.in_flight_poison(trace)
    steps = prepare.replayed(trace)
    prepare.prepare_step(st, steps[0], trace.rows[steps[0].step], flight, Chunk("cpu"))
    s = steps[1]
    c = _one_less(trace.columns[s.step])
    assert prepare.may(s, c, True)
    chunk = Chunk("cpu")
    caps = dict(st.graph_caps)
    got, shared, _, fill = _take(st, s, c, flight, chunk)
    assert got is not None and not fill and got[1] is None
    assert chunk.n == 0 and st.graph_caps == caps
    _same_batch(got[0], build_step(s, trace.rows[s.step], trace.model.page_size, st.guard,
                                   shared, c, checked=True))
    assert len(set(got[0].q_len.tolist())) == 2


def _one_less(c: Columns) -> Columns:
    """The columns with the last row's last query and append dropped."""
    out = dict(c)
    for k in ("q_len", "append_pos_len", "rope_pos_len", "tokens_len"):
        out[k] = c[k].copy()
        out[k][-1] -= 1
    for k in ("append_pos", "rope_pos", "tokens"):
        out[k] = c[k][:-1].copy()
    return out
