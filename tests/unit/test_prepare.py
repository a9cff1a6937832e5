"""gpu_backend/host/prepare.py: steps are prepared one chunk ahead of the steps handed out, a step
at
a time, and how the steps fall into chunks changes nothing the replay sees; the page lists come
from the trace's Arrow columns and flatten as the rows' tuples do."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from replay_traces import (
    FAULTS,
    SCENARIOS,
    Builder,
    any_trace,
    big_verify,
    default_small,
    named_trace,
    prompt,
)

from gpu_backend import trace as trace_mod
from gpu_backend.host import events, prepare, staging, truth
from gpu_backend.host.graph_block import H200, Planner
from gpu_backend.host.layout import build_step, columns
from gpu_backend.host.prepare import HostState, Prepared, prepared_steps
from gpu_backend.host.truth import truth_shape
from gpu_backend.replay.cpu import ReferenceKernels
from gpu_backend.replay.loop import GUARD_PAGES, replay
from gpu_backend.trace import TraceData, load_trace
from sim.trace.reader import read_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> TraceData:
    return load_trace(big_verify(tmp_path_factory.mktemp("p") / "big", batch=8, kv=256, steps=9))


def _state(trace: TraceData) -> HostState:
    slots, _, last = truth_shape(trace)
    return HostState(trace, GUARD_PAGES, trace.model.max_position, last=last,
                     free=list(range(slots))[::-1], graphs=Planner.for_model(trace.model, H200))


def test_each_step_handed_out_follows_one_step_prepared(trace: TraceData,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 1, 1, 2, 3, 3 steps (`staging.ramp`): a chunk is prepared whole before its
    first step is handed out, then one step of the next chunk before each later step; the last
    chunk's steps follow once all are prepared."""
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 3)
    made: list[int] = []
    real = prepare.prepare_step

    def counted(*a: Any) -> Prepared:
        made.append(a[1].step)
        return real(*a)

    monkeypatch.setattr(prepare, "prepare_step", counted)
    seen = [len(made) for _ in prepared_steps(trace, _state(trace), "cpu")]
    n = len(trace.steps)
    assert n == 10 and seen == [1, 2, 4, 5, 7, 8, 9, 10, 10, 10]


def test_an_eager_steps_kernels_run_before_the_next_step_is_prepared(
        trace: TraceData, monkeypatch: pytest.MonkeyPatch) -> None:
    """`loop._loop` queues an eager step's kernels, then prepares the step after it (whose
    touched pages its watch checks ahead): the prompts' step's device work starts one step's
    preparation sooner. Every step runs, in order, after its own preparation."""
    order: list[tuple[str, int]] = []
    real = prepare.prepare_step

    def counted(*a: Any) -> Prepared:
        order.append(("prepare", a[1].step))
        return real(*a)

    class Logged(ReferenceKernels):
        def run_step(self, pool: Any, b: Any, *a: Any) -> Any:
            order.append(("run", b.step))
            return super().run_step(pool, b, *a)

    monkeypatch.setattr(prepare, "prepare_step", counted)
    m = trace.model
    res = replay(trace, Logged(m.num_q_heads, m.num_blocks), "cpu")
    steps = [s.step for s in trace.steps if trace.rows[s.step]]
    assert [k for what, k in order if what == "run"] == steps
    at = {x: i for i, x in enumerate(order)}
    assert at[("run", steps[0])] < at[("prepare", steps[1])]  # the prompts' step
    assert all(at[("prepare", k)] < at[("run", k)] for k in steps)
    assert res.counts()["ok"] == len(res.rows) > 0


def test_the_ramp() -> None:
    sizes = Counter(staging.ramp(i, 4, 1) for i in range(20))
    assert [sizes[c] for c in sorted(sizes)] == [1, 1, 2, 3, 4, 4, 4, 1]
    assert [staging.ramp(i, 3, 2) for i in range(8)] == [0, 0, 1, 2, 2, 3, 3, 3]


def _arrays(p: Prepared) -> dict[str, np.ndarray]:
    return {k: p.dv[k].numpy().copy() for k in p.dv}


def test_the_chunking_changes_no_array(trace: TraceData, monkeypatch: pytest.MonkeyPatch) -> None:
    want = [(p.b.step, p.graph, _arrays(p)) for p in prepared_steps(trace, _state(trace), "cpu")]
    for steps in (1, 4):
        monkeypatch.setattr(prepare, "CHUNK_STEPS", steps)
        got = [(p.b.step, p.graph, _arrays(p))
               for p in prepared_steps(trace, _state(trace), "cpu")]
        assert [g[:2] for g in got] == [w[:2] for w in want]
        for (_, _, a), (_, _, b) in zip(got, want, strict=True):
            assert a.keys() == b.keys()
            assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["append_past_alloc", "clean_mtp", "overlap_uncorrected"])
def test_the_chunking_changes_no_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         name: str) -> None:
    t = load_trace(SCENARIOS[name](tmp_path / name))
    m = t.model

    def rows() -> list[tuple[Any, ...]]:
        res = replay(t, ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu")
        return [(r.step, r.row, r.verdict, r.err, r.message) for r in res.rows]

    want = rows()
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 1)
    assert rows() == want


def _batches_equal(a: Any, b: Any) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
               for x, y in zip(vars(a).values(), vars(b).values(), strict=True))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_arrow_columns_flatten_as_the_rows_tuples(tmp_path: Path, name: str) -> None:
    """`TraceData.columns` (from the Arrow columns) hold the rows as `layout.columns` builds them
    from the tuples: every step flattens to the same batch either way."""
    t = load_trace(SCENARIOS[name](tmp_path / name))
    for s in t.steps:
        rows = t.rows[s.step]
        got, want = t.columns[s.step], columns(rows)
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                   for k in got)
        if rows:
            fast = build_step(s, rows, t.model.page_size, 16, cols=t.columns[s.step])
            assert _batches_equal(fast, build_step(s, rows, t.model.page_size, 16))


def test_columns_that_do_not_fit_the_rows_are_not_used(tmp_path: Path) -> None:
    t = load_trace(SCENARIOS["clean_mtp"](tmp_path / "t"))
    s = t.steps[2]
    rows = t.rows[s.step]
    short = {k: v[:-1] for k, v in t.columns[s.step].items()}
    assert _batches_equal(build_step(s, rows, t.model.page_size, 16, cols=short),
                          build_step(s, rows, t.model.page_size, 16))


def test_the_columns_of_rows_out_of_table_order_are_gathered(trace: TraceData) -> None:
    """A step whose rows are not one contiguous run of rows.parquet in row order gets its
    columns gathered row by row: here every step's rows taken in reverse."""
    table = read_trace(trace.path).tables["rows"]
    steps = table.column("step").to_pylist()
    order = {s.step: [i for i, x in enumerate(steps) if x == s.step][::-1] for s in trace.steps}
    got = trace_mod._columns(table, order)
    for s in trace.steps:
        want = columns(trace.rows[s.step][::-1])
        assert all(np.array_equal(got[s.step][k], want[k]) for k in want)
    for s in trace.steps:  # the module's big_verify trace too, in order
        rows = trace.rows[s.step]
        B = trace.model.page_size
        assert _batches_equal(build_step(s, rows, B, 16, cols=trace.columns[s.step]),
                              build_step(s, rows, B, 16))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_fast_groups_are_the_general_ones(tmp_path: Path, name: str) -> None:
    """`truth._identity_group` (steady steps of equal-width gen rows) and
    `truth._single_row_group` (a context row) give the arrays and the groups the general
    `ref_groups` gives, on every scenario step they take."""
    t = load_trace(SCENARIOS[name](tmp_path / name))
    taken = ctx = 0
    for s in t.steps:
        if not t.rows[s.step]:
            continue
        b = build_step(s, t.rows[s.step], t.model.page_size, 16, cols=t.columns.get(s.step))
        slots = np.arange(3, 3 + b.num_rows, dtype=np.int64)[::-1 if s.step % 2 else 1].copy()
        fast: dict[str, np.ndarray] = {}
        slow: dict[str, np.ndarray] = {}
        got = truth.ref_groups(b, slots, fast)
        want = truth.ref_groups(b, slots, slow, fast=False)
        assert [replace(g, true_limit=False) for g in got] == want
        # a context row's own group takes its limits from the step's true positions
        for g in got:
            if g.true_limit:
                assert g.span is not None
                assert [b.true_pos[g.span[0]: g.span[1]].tolist()] == \
                    slow.pop(g.pre + "limit").tolist()
        assert list(fast) == list(slow)
        assert all(fast[k].dtype == slow[k].dtype and fast[k].tolist() == slow[k].tolist()
                   for k in fast)
        taken += not b.is_ctx.any() and bool((b.q_len == b.q_len[0]).all())
        ctx += int((b.is_ctx & (b.q_len > 0)).sum())
    assert taken and ctx  # steps and rows the fast paths take


def test_a_steps_context_rows_together_are_its_rows_alone(tmp_path: Path) -> None:
    """`ref_groups(together=True)` (where `reference_triton.attend_rows` runs) makes a prompts'
    step's
    context rows, of several lengths, one group: each row's first token, queries and committed
    keys, from which the kernel takes the limits each row's own group stages; the slots, key
    bound and lowest limit of those groups. A lone context row keeps its own group."""
    t = load_trace(named_trace(tmp_path, "big", 6))
    s = t.steps[0]
    b = build_step(s, t.rows[s.step], t.model.page_size, 16, cols=t.columns.get(s.step))
    assert b.is_ctx.all() and len(set(b.q_len.tolist())) > 1  # prompts of several lengths
    slots = np.arange(5, 5 + b.num_rows, dtype=np.int64)
    alone: dict[str, np.ndarray] = {}
    together: dict[str, np.ndarray] = {}
    rows = truth.ref_groups(b, slots, alone)
    (g,) = truth.ref_groups(b, slots, together, together=True)
    assert len(rows) == b.num_rows and not any(r.ragged for r in rows)
    first, width, committed = together["g0_rows"]
    for i, r in enumerate(rows):
        assert r.span == (first[i], first[i] + width[i])
        assert r.true_limit and b.true_pos[r.span[0]: r.span[1]].tolist() == \
            list(range(committed[i], committed[i] + width[i]))
    assert np.array_equal(together["g0_slots"],
                          np.concatenate([alone[r.pre + "slots"] for r in rows]))
    assert (g.R, g.W, g.L, g.s0, g.lo, g.identity, g.span, g.view, g.ragged) == \
        (b.num_rows, int(b.q_len.max()), max(r.L for r in rows), 5, min(r.lo for r in rows),
         False, None, False, True)
    one = build_step(s, t.rows[s.step][:1], t.model.page_size, 16)
    assert truth.ref_groups(one, slots, {}, together=True) == \
        truth.ref_groups(one, slots, {})


def test_long_context_rows_stay_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of more than `TOGETHER_KEYS` keys keep a group each, together or not; the rest of
    the step's context rows still share one."""
    t = load_trace(named_trace(tmp_path, "big", 6))
    s = t.steps[0]
    b = build_step(s, t.rows[s.step], t.model.page_size, 16, cols=t.columns.get(s.step))
    slots = np.arange(b.num_rows, dtype=np.int64)
    keys = b.committed.astype(np.int64) + b.q_len
    monkeypatch.setattr(truth, "TOGETHER_KEYS", int(np.sort(keys)[2]))
    arrays: dict[str, np.ndarray] = {}
    groups = truth.ref_groups(b, slots, arrays, together=True)
    long = int((keys > truth.TOGETHER_KEYS).sum())
    assert 0 < long < b.num_rows - 1 and len(groups) == 1 + long
    assert groups[0].ragged and groups[0].R == b.num_rows - long
    assert all(g.R == 1 and not g.ragged for g in groups[1:])
    assert sorted(arrays["g0_slots"].tolist() + [int(arrays[g.pre + "slots"][0])
                                                 for g in groups[1:]]) == slots.tolist()
    monkeypatch.setattr(truth, "TOGETHER_KEYS", int(keys.min()) - 1)
    assert truth.ref_groups(b, slots, {}, together=True) == truth.ref_groups(b, slots, {})


def _truth_shape_rows(trace: TraceData) -> tuple[int, int, dict[int, int]]:
    """truth_shape as it was, a loop over the rows: the oracle."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    span = 1
    for step in sorted(trace.rows):
        for r in trace.rows[step]:
            span = max(span, r.committed + r.q_len)
            first.setdefault(r.request, step)
            last[r.request] = step
    starts, ends = Counter(first.values()), Counter(last.values())
    live = peak = 0
    for step in sorted(trace.rows):
        live += starts[step]
        peak = max(peak, live)
        live -= ends[step]
    return max(peak, 1), span, last


@pytest.mark.parametrize("name", ["default40", *SCENARIOS, *FAULTS[:6]])
def test_truth_shape_is_the_loop_over_rows(tmp_path: Path, name: str) -> None:
    path = default_small(tmp_path) if name == "default40" else any_trace(tmp_path, name)
    trace = load_trace(path)
    got = truth_shape(trace)
    assert got == _truth_shape_rows(trace)
    assert got[0] >= 1 and got[2]


def test_truth_shape_counts_a_request_live_at_its_last_step(tmp_path: Path) -> None:
    # request 0's last row and request 1's first are in step 1: both hold a slot there
    b = Builder()
    b.request(0, prompt(0, 20))
    b.request(1, prompt(1, 20))
    b.step([b.ctx(0)])
    b.step([b.gen(0, 0, 0), b.ctx(1)])
    b.step([b.gen(1, 0, 0)])
    trace = load_trace(b.write(tmp_path / "handover", "handover"))
    assert truth_shape(trace) == _truth_shape_rows(trace) == (2, 21, {0: 1, 1: 2})


def test_truth_shape_keeps_a_requests_slot_while_it_is_away() -> None:
    """A request's rows need not be in consecutive steps: it holds its slot from its first
    row's step to its last's. Request 1 at steps 0 and 2, requests 2 and 3 at step 1 alone:
    three slots (two if 1 gave its slot up while away)."""
    def row(req: int, committed: int, q_len: int) -> SimpleNamespace:
        return SimpleNamespace(request=req, committed=committed, q_len=q_len)

    rows = {0: [row(1, 0, 5)], 1: [row(2, 0, 7), row(3, 0, 9)], 2: [row(1, 5, 1)]}
    cols = {s: {k: np.array([getattr(r, k) for r in rs], np.int64)
                for k in ("request", "committed", "q_len")} for s, rs in rows.items()}
    trace = SimpleNamespace(rows=rows, columns=cols)
    want = _truth_shape_rows(trace)  # type: ignore[arg-type]
    assert truth_shape(trace) == want == (3, 9, {1: 2, 2: 1, 3: 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_first_steps_poison_is_left_to_the_fresh_pool(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          name: str) -> None:
    """The replay's first step stages no poison before its first copy (`events.fresh_pool`:
    the pool starts all NaN), later steps keep theirs, and the verdicts are those of a replay
    that poisons it."""
    t = load_trace(SCENARIOS[name](tmp_path / name))
    m = t.model
    real = prepare.prepare_step

    def run() -> tuple[list[tuple[Any, ...]], list[list[Any]]]:
        made: list[Prepared] = []

        def kept(*a: Any) -> Prepared:
            made.append(real(*a))
            return made[-1]

        monkeypatch.setattr(prepare, "prepare_step", kept)
        res = replay(t, ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu")
        # read once the replay has completed them: a deferred prompts' step gets its pool
        # operations in `complete` (`prepare._content_first`)
        return [(r.step, r.row, r.verdict, r.err, r.message) for r in res.rows], \
            [p.ops for p in made]

    want, ops = run()
    assert not ops[0] or ops[0][0][0] != "nan"
    monkeypatch.setattr(events, "fresh_pool", lambda ops, arrays: ops)
    got, poisoned = run()
    assert got == want
    assert ops[1:] == poisoned[1:]
    assert poisoned[0][0][0] == "nan"  # every scenario allocates its first step's pages


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_fresh_pools_dropped_poison_is_never_made_rows(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          name: str) -> None:
    """`fresh_pool` drops the first step's poison before `join_rewind` turns poisoned pages
    into pool rows (0.5 ms of a 64 x 2k prompts' step, 2 at 8k, on a development machine)."""
    t = load_trace(SCENARIOS[name](tmp_path / name))
    given: list[list[Any]] = []
    real = events.join_rewind

    def kept(st: Any, ops: Any, *a: Any) -> Any:
        given.append(list(ops))
        return real(st, ops, *a)

    monkeypatch.setattr(events, "join_rewind", kept)
    monkeypatch.setattr("gpu_backend.host.prepare_jit.pool_ops", lambda *a: None)  # all join_rewind
    steps = list(prepared_steps(t, _state(t), "cpu"))
    assert len(given) == len(steps) > 1
    assert not given[0] or given[0][0][0] != "nan"
