"""gpu_backend/host/steady_jit.py: a steady step past its truth slots, in one compiled pass, is
staged word for word and view for view as `prepare`'s own way stages it (its oracle), with the
same groups, flags and host state, on every step of the replay test traces."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from replay_traces import FAULTS, SCENARIOS, named_trace

from gpu_backend.host import events, prepare, steady_jit
from gpu_backend.host.graph_block import H200, Planner
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


def _steps(trace: TraceData, words: int = 0) -> list[tuple[Any, ...]]:
    """Every replayed step prepared into a chunk of its own (`Chunk(words=)`: written in
    place, from a buffer of that many words): (its chunk's words, its views
    (name -> slot, in order), graph key, wpages, wcheck, wok, then its other fields), then the
    host state after the last one."""
    st = _state(trace)
    flight = events.in_flight_poison(trace)
    out = []
    for s in prepare.replayed(trace):
        chunk = Chunk("cpu", words)
        p = prepare.prepare_step(st, s, trace.rows[s.step], flight, chunk)
        staged = chunk.words()
        out.append((staged, list(p.dv.slots.items()), p.graph, p.wpages, p.wcheck, p.wok,
                    p.touched, p.ops, p.groups, p.fill, p.engine_nan, p.truth_same,
                    p.q_identity, p.deferred))
    # the host state the steps leave
    out.append((st.prev_step, st.slot, st.free, st.shared, st.held is None, st.graph_caps))
    return out


def _general(trace: TraceData, words: int = 0) -> list[tuple[Any, ...]]:
    """`_steps` with every step staged `prepare`'s general way (no steady step: the pass's
    oracle)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(prepare, "may", lambda *a: False)
        return _steps(trace, words)


def _poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's buffers hold garbage where nothing is written (as reused pinned memory
    does), so a word the pass leaves unwritten shows."""
    real = Chunk.pinned

    def pinned(self: Chunk, n: int) -> torch.Tensor:
        return real(self, n).fill_(-0x5A5A5A5A5A5A5A5)

    monkeypatch.setattr(Chunk, "pinned", pinned)


@pytest.mark.parametrize("name", NAMES)
def test_every_step_is_staged_as_rest_stages_it(tmp_path: Path, name: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The same words, views (in the same order), graph key, target pages, pool operations,
    reference groups and flags with the pass as without it (`prepare`'s one
    call, and `packed` where its room was short), the same host state after the last step, and
    the pass packed every graph step (on the big trace, every generation step). The pass
    writes its block where the chunk stages it (`Chunk.claim`): into a queued array, or into
    the chunk's buffer, grown mid-block when it is small."""
    trace = load_trace(named_trace(tmp_path, name, 9))
    want = _general(trace)
    packed = []
    real = steady_jit.finish

    def counted(*a: Any) -> Any:  # every packed step, the one call's or `packed`'s
        packed.append(True)
        return real(*a)

    monkeypatch.setattr(steady_jit, "finish", counted)
    _poisoned(monkeypatch)
    for words in (0, 1000):
        packed.clear()
        got = _steps(trace, words)
        assert len(got) == len(want) > 1 and got[-1] == want[-1]
        for g, w in zip(got[:-1], want[:-1], strict=True):
            assert g[0].dtype == w[0].dtype and np.array_equal(g[0], w[0])
            assert g[1] == w[1] and g[2] == w[2] and g[4] == w[4] and g[6:] == w[6:]
            for i in (3, 5):  # wpages, wok
                assert g[i].dtype == w[i].dtype and np.array_equal(g[i], w[i])
    graph_steps = sum(w[2] is not None for w in want[:-1])
    assert sum(packed) == graph_steps
    if name == "big":
        assert graph_steps == len(want) - 2  # every generation step


def test_a_step_of_mixed_widths_is_left_to_prepare(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose rows are not all one width is no graph step for the pass: it stages
    nothing and grows no capacity, and `prepare` stages the step its own way (as when
    FlashInfer's planner would refuse the page counts)."""
    trace = load_trace(named_trace(tmp_path, "big", 3))
    st = _state(trace)
    seen: list[Any] = []
    real = steady_jit.packed

    def mixed(caps: Any, b: Any, *a: Any) -> Any:
        q_len = b.q_len.copy()
        q_len[-1] += 1
        chunk = a[-1]
        before = (dict(caps), chunk.n, len(chunk.parts))
        got = real(caps, replace(b, q_len=q_len), *a)
        seen.append((got, before, (dict(caps), chunk.n, len(chunk.parts))))
        return got

    def short(*a: Any) -> Any:  # the one call's room is short: `packed` stages the step
        return 7

    flight = events.in_flight_poison(trace)
    steps = prepare.replayed(trace)
    monkeypatch.setattr(steady_jit, "packed", mixed)
    monkeypatch.setattr(steady_jit, "_most", short)
    prepare.prepare_step(st, steps[0], trace.rows[steps[0].step], flight, Chunk("cpu"))
    p = prepare.prepare_step(st, steps[1], trace.rows[steps[1].step], flight, Chunk("cpu"))
    assert len(seen) == 1 and seen[0][0] is None and seen[0][1] == seen[0][2]  # the gen step
    assert p.graph is not None and "gblk" in p.dv.slots  # `prepare`'s own way


def test_a_block_over_its_room_is_written_again_where_it_fits(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """When the room claimed for a block is too small (`_most` too low), the pass writes
    nothing there, gives it back and writes the block in a claim of its size: the same words."""
    trace = load_trace(named_trace(tmp_path, "big", 5))
    want = _general(trace)
    monkeypatch.setattr(steady_jit, "_most", lambda *a: 7)
    _poisoned(monkeypatch)
    for words in (0, 1000):
        got = _steps(trace, words)
        assert got[-1] == want[-1]
        for g, w in zip(got[:-1], want[:-1], strict=True):
            assert np.array_equal(g[0], w[0]) and g[1] == w[1] and g[2] == w[2]


def _arrays(trace: TraceData) -> list[tuple[Any, dict[str, np.ndarray], dict[str, Any]]]:
    """Every replayed step as the loop gets it (staged, uploaded): (graph key, each array's
    values by name, its slots)."""
    st = _state(trace)
    return [(p.graph, {k: p.dv[k].numpy().copy() for k in p.dv}, dict(p.dv.slots))
            for p in prepare.prepared_steps(trace, st, "cpu")]


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("name", ["big", "clean_mtp", "overlap_uncorrected",
                                  "plan_keyed_by_batch", "reserved_table_fa2",
                                  "stale_graph_pages"])
def test_what_a_graph_block_holds_is_read_from_it(tmp_path: Path, name: str, pack: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph step's events' rows, touched pages and target pages are views of its block's
    fields (`steady_jit.rest_slots`), both ways of staging it: each the values it has staged on
    its own, and inside the block."""
    trace = load_trace(named_trace(tmp_path, name, 9))
    if not pack:
        monkeypatch.setattr(prepare, "may", lambda *a: False)
    got = _arrays(trace)
    monkeypatch.setattr(steady_jit, "rest_slots",
                        lambda chunk, rest, ops, at: {n: chunk.add(a) for n, a in rest.items()})
    want = _arrays(trace)
    viewed = 0
    for (key, g, slots), (_, w, _) in zip(got, want, strict=True):
        assert list(g) == list(w)
        for k in g:
            assert np.array_equal(g[k], w[k]), k
        if key is None:
            continue
        (size,), _, start = slots["gblk"]
        inside = [k for k in g if k.startswith("ev") or k in ("touched", "wpages")]
        assert all(start <= slots[k][2] < start + size for k in inside)
        viewed += len(inside)
    assert viewed > 0


def test_events_rows_are_viewed_one_after_the_other_in_the_ops_order() -> None:
    """Several runs of poisoned rows lie in gr_prows in the order of the step's operations,
    whatever the order they were staged in; what the block does not hold is staged."""
    chunk = Chunk("cpu")
    rest = {"ev1": np.arange(3), "seq_lens": np.arange(2), "ev0": np.arange(5),
            "touched": np.arange(4), "wpages": np.arange(6)}
    at = {"gr_prows": 100, "gr_touched": 50, "gr_wpages": 70}
    got = steady_jit.rest_slots(chunk, rest, [("nan", 0, 0, 0), ("nan", 1, 0, 0)], at.__getitem__)
    assert list(got) == list(rest) and chunk.n == 2
    assert got == {"ev1": ((3,), (1,), 105), "seq_lens": ((2,), (1,), 0),
                   "ev0": ((5,), (1,), 100), "touched": ((4,), (1,), 50),
                   "wpages": ((6,), (1,), 70)}
