"""gpu_backend/host/prepare.py's deferred first step: the replay loop queues the prompts' step's
content and reference before the rest of its preparation (`prepare.complete`), and the step it
completes is the one `prepare_step` makes whole."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from replay_traces import FAULTS, SCENARIOS, named_trace

from gpu_backend.device import pool as pool_mod
from gpu_backend.device import reference
from gpu_backend.host import events, prepare
from gpu_backend.host.batch import StepBatch
from gpu_backend.host.graph_block import H200, Planner
from gpu_backend.host.layout import prompts_batch
from gpu_backend.host.prepare import HostState, Prepared, complete, prepared_steps
from gpu_backend.host.staging import I32, Chunk, FromRows, Joined, stage
from gpu_backend.host.truth import truth_shape
from gpu_backend.replay import loop
from gpu_backend.replay.cpu import ReferenceKernels
from gpu_backend.replay.loop import GUARD_PAGES, replay
from gpu_backend.trace import TraceData, load_trace

NAMES = ["default40", "big", *sorted(SCENARIOS), *FAULTS[:6]]


def _trace(tmp: Path, name: str) -> TraceData:
    return load_trace(named_trace(tmp, name, 6))


def _state(trace: TraceData, together: bool = False) -> HostState:
    slots, _, last = truth_shape(trace)
    return HostState(trace, GUARD_PAGES, trace.model.max_position, last=last,
                     free=list(range(slots))[::-1], graphs=Planner.for_model(trace.model, H200),
                     together=together)


def _steps(trace: TraceData, defer: bool, together: bool = False
           ) -> list[tuple[Prepared, dict[str, np.ndarray]]]:
    out = []
    for p in prepared_steps(trace, _state(trace, together), "cpu", defer=defer):
        complete(p)
        out.append((p, {k: p.dv[k].numpy().copy() for k in p.dv}))
    return out


_FIELDS = ("ops", "touched", "fill", "engine_nan", "truth_same", "q_identity", "wcheck", "graph",
           "deferred")


@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_a_deferred_step_completes_to_the_whole_one(tmp_path: Path, name: str,
                                                    together: bool) -> None:
    """Every step of a replay with its first step deferred has the arrays, pool operations,
    checked pages, graph and batch of the undeferred replay's (every trace here starts with a
    prompts' step: `layout.prompts_batch`'s path)."""
    trace = _trace(tmp_path, name)
    want, got = _steps(trace, False, together), _steps(trace, True, together)
    assert len(got) == len(want) > 0
    for (p, a), (q, b) in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k], equal_nan=True)
                   for k in a), p.b.step
        assert all(getattr(p, f) == getattr(q, f) for f in _FIELDS)
        assert p.groups == q.groups
        assert np.array_equal(p.wpages, q.wpages) and np.array_equal(p.wok, q.wok)
        assert _same_batch(p.b, q.b), p.b.step
    assert isinstance(got[0][0].dv, Joined) or got[0][0].graph is not None


def _same_batch(a: StepBatch, b: StepBatch, only: Iterable[str] | None = None) -> bool:
    names = [f.name for f in fields(StepBatch)] if only is None else only
    for n in names:
        x, y = getattr(a, n), getattr(b, n)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


# the fields `layout.prompts_batch` leaves empty: the pages'
_PAGES = {"kv_indptr", "kv_indices", "last_page_len", "kv_len", "block_table",
          "allowed_pages", "engine_write", "write_ok", "reject_page", "reject_slot",
          "xqa_indptr", "xqa_indices", "xqa_last_page_len", "runs"}


@pytest.mark.parametrize("name", NAMES)
def test_a_prompts_step_is_launched_from_its_rows_before_its_pages(tmp_path: Path,
                                                                    name: str) -> None:
    """The deferred prompts' step before `complete`: no pool operations, no pages, and every
    other field of its batch `build_step`'s (but its tokens' rows where the device makes its
    content's inputs from its rows: `staging.FromRows`)."""
    trace = _trace(tmp_path, name)
    p = next(prepared_steps(trace, _state(trace), "cpu", defer=True))
    q = next(prepared_steps(trace, _state(trace), "cpu"))
    assert p.deferred is not None and p.ops == [] and not p.b.kv_indices.size
    skip = _PAGES
    if isinstance(p.dv, FromRows):
        assert p.b.row_of_token is None and p.b.true_pos is None and p.b.app_row is None
        skip = _PAGES | {"row_of_token", "true_pos", "app_row"}
    rest = [f.name for f in fields(StepBatch) if f.name not in skip]
    assert _same_batch(p.b, q.b, rest)
    assert q.b.kv_indices.size  # what the test would miss if the pages were empty anyway
    complete(p)
    assert _same_batch(p.b, q.b) and p.ops == q.ops


def test_only_a_step_of_prompts_is_launched_before_its_pages(tmp_path: Path) -> None:
    """`layout.prompts_batch` takes a step of context rows whose appends are their queries,
    each with queries; anything else is prepared whole before its launches."""
    trace = _trace(tmp_path, "big")
    s = trace.steps[0]
    cols = trace.columns[s.step]
    assert prompts_batch(s, cols, trace.model.page_size, GUARD_PAGES) is not None
    gen = next(x for x in trace.steps if trace.rows[x.step] and x.step != s.step)
    assert prompts_batch(gen, trace.columns[gen.step], trace.model.page_size, 0) is None
    for change in ({"is_ctx": ~cols["is_ctx"][:1]}, {"q_len": cols["q_len"] * 0},
                   {"append_pos_len": cols["append_pos_len"] + 1}):
        bad = dict(cols)
        for k, v in change.items():
            bad[k] = np.concatenate([v, cols[k][len(v):]])
        assert prompts_batch(s, bad, trace.model.page_size, GUARD_PAGES) is None, change
    # columns not checked on loading: the batch is made whole before the launches
    whole = replace(trace, checked=trace.checked - {s.step})
    p = next(prepared_steps(whole, _state(whole), "cpu", defer=True))
    assert p.deferred is not None and p.b.kv_indices.size


def test_before_completion_only_the_content_and_the_reference_are_staged(
        tmp_path: Path) -> None:
    trace = _trace(tmp_path, "big")
    p = next(prepared_steps(trace, _state(trace, together=True), "cpu", defer=True))
    assert p.deferred is not None and p.b.step == trace.steps[0].step
    staged = set(p.dv)
    assert {"tslot", "true_pos", "app_tok_m", "app_pos_m"} <= staged
    assert not staged & {"kv_indices", "kv_indptr", "touched", "wpages", "append_pos"}
    # made from the rows: the tokens and a few numbers a row staged, not four words a token
    assert isinstance(p.dv, FromRows) and not staged & set(FromRows.SOURCES)
    tokens = int(trace.columns[p.b.step]["q_len"].sum())
    assert tokens <= p.dv.chunk.bufs["d64"].numel() < tokens + 64 * p.b.num_rows
    complete(p)
    assert p.deferred is None and {"kv_indices", "touched", "wpages"} <= set(p.dv)
    complete(p)  # once only
    assert isinstance(p.dv, Joined) and len(p.dv) == len(set(p.dv))


def _order(trace: TraceData, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """What the replay did to the first step, in order: its reference queued, the rest of its
    preparation (`prepare._rest`), its kernels."""
    order: list[tuple[str, int]] = []
    ref, rest = reference.reference, prepare._rest

    def logged_ref(truth: Any, dv: Any, groups: Any, q: Any, out: Any = None) -> torch.Tensor:
        order.append(("reference", len(q)))
        return ref(truth, dv, groups, q, out)

    def logged_rest(*a: Any) -> None:
        order.append(("rest", a[-1].b.step))
        rest(*a)

    class Logged(ReferenceKernels):
        def run_step(self, pool: Any, b: Any, *a: Any) -> Any:
            order.append(("run", b.step))
            return super().run_step(pool, b, *a)

    monkeypatch.setattr(loop, "reference", logged_ref)
    monkeypatch.setattr(prepare, "_rest", logged_rest)
    m = trace.model
    res = replay(trace, Logged(m.num_q_heads, m.num_blocks), "cpu")
    assert res.counts()["ok"] == len(res.rows) > 0
    return order[:3]


def test_the_prompts_reference_is_queued_before_the_rest_is_prepared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompts' step: reference, then the rest of its preparation, then its kernels. Without
    the defer, its whole preparation comes first and the reference last (the order this test
    fails on)."""
    trace = _trace(tmp_path, "big")
    first = trace.steps[0].step
    got = _order(trace, monkeypatch)
    assert [k for k, _ in got] == ["reference", "rest", "run"] and got[1:] == [
        ("rest", first), ("run", first)]
    real = prepare.prepare_step
    monkeypatch.setattr(prepare, "prepare_step", lambda *a: real(*a[:5]))  # no defer
    assert [k for k, _ in _order(trace, monkeypatch)] == ["rest", "run", "reference"]


def test_the_loop_makes_its_pool_and_watch_once_the_first_reference_is_queued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`loop.Rig`: the pool (its poison), the watch (its first sums) and the graphs are made
    after the first step's content and reference are queued, not before them: the device has
    nothing to run until that launch. Once, for every step."""
    trace = _trace(tmp_path, "big")
    order: list[str] = []
    ref, pool = reference.reference, pool_mod.KVPool

    def logged_ref(*a: Any) -> torch.Tensor:
        order.append("reference")
        return ref(*a)

    class Logged(pool):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any) -> None:
            order.append("pool")
            super().__init__(*a)

    monkeypatch.setattr(loop, "reference", logged_ref)
    monkeypatch.setattr(loop, "KVPool", Logged)
    m = trace.model
    res = replay(trace, ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu")
    assert res.counts()["ok"] == len(res.rows) > 0 and res.watch == "incremental"
    assert order[:2] == ["reference", "pool"] and order.count("pool") == 1
    assert order.count("reference") == len(prepare.replayed(trace)) > 1


def test_a_step_deferred_before_the_graphs_are_known_is_no_graph_step(tmp_path: Path) -> None:
    """The loop sets `HostState.graphs` only once its first step's content and reference are
    queued (`loop.Rig`). A step deferred before then completes as an eager step with its
    arrays whole: a graph reads the content's arrays and the rest as one block, which a deferred
    step stages apart (the layout raised KeyError on such a step)."""
    trace = _trace(tmp_path, "big")
    s0, s1 = prepare.replayed(trace)[:2]
    flight = events.in_flight_poison(trace)

    def second(defer: bool) -> Prepared:
        st = _state(trace)
        planner = st.graphs
        st.graphs = None if defer else planner
        complete(prepare.prepare_step(st, s0, trace.rows[s0.step], flight, Chunk("cpu")))
        p = prepare.prepare_step(st, s1, trace.rows[s1.step], flight, Chunk("cpu"), defer)
        st.graphs = planner
        complete(p)
        return p

    assert second(False).graph is not None  # a graph step when the graphs are known
    p = second(True)
    assert p.graph is None and p.deferred is None
    assert {"app_tok_m", "kv_indices", "wpages"} <= set(p.dv)


@pytest.mark.parametrize("name", ["big", "clean_mtp", "overlap_uncorrected", "append_past_alloc",
                                  *FAULTS[:4]])
def test_the_defer_changes_no_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      name: str) -> None:
    trace = _trace(tmp_path, name)
    m = trace.model

    def rows() -> list[tuple[Any, ...]]:
        res = replay(trace, ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu")
        return [(r.step, r.row, r.verdict, r.err, r.message) for r in res.rows]

    want = rows()
    real = prepare.prepare_step
    monkeypatch.setattr(prepare, "prepare_step", lambda *a: real(*a[:5]))
    assert rows() == want


def test_joined_reads_each_array_from_its_own_chunk() -> None:
    a, b = Chunk("cpu"), Chunk("cpu")
    first = stage(a, {"x": np.arange(3), "y": np.array([7, 8])})
    then = stage(b, {"z": np.arange(5) * 2, "w": np.array([[1, 2], [3, 4]])})
    a.upload()
    b.upload()
    j = Joined(first, then)
    assert sorted(j) == ["w", "x", "y", "z"] and len(j) == 4
    assert j["x"].tolist() == [0, 1, 2] and j.view("y", I32).dtype == torch.int32
    assert j["z"].tolist() == [0, 2, 4, 6, 8] and j["w"].tolist() == [[1, 2], [3, 4]]
    assert j.chunk is b
    buf, off, n = j.span("y")
    assert buf is a.bufs["d64"] and buf[off: off + n].tolist() == [7, 8]
    buf, off, n = j.span("z")
    assert buf is b.bufs["d64"] and n == 5
    with pytest.raises(KeyError):
        j["nothing"]


@pytest.mark.parametrize(("timing", "attn_timing", "device", "want"), [
    (False, False, "cuda", True), (False, False, "cuda:0", True), (False, False, "cpu", False),
    (True, False, "cuda", False), (False, True, "cuda", False)])
def test_the_reference_gets_a_stream_of_its_own_only_on_cuda_and_untimed(
        timing: bool, attn_timing: bool, device: str,
        want: bool) -> None:
    """A concurrent reference would run inside the timed launches' events (`_reference_beside`):
    timed kernels keep it in order."""
    class Timed:
        name = "flashinfer"

    k = Timed()
    k.timing, k.attn_timing = timing, attn_timing  # type: ignore[attr-defined]
    assert loop._reference_beside(k, device) is want  # type: ignore[arg-type]
