"""gpu_backend/host/prepare_jit.py: a generation step's compiled preparation passes give what the
numpy
they replaced gives, pass by pass on drawn arrays and step by step on whole replays."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replay_traces import FAULTS, SCENARIOS, Builder, named_trace, prompt

from gpu_backend.device.pool import M
from gpu_backend.host import layout_jit, prepare, prepare_jit
from gpu_backend.host import truth as truth_mod
from gpu_backend.host.graph_block import H200, Planner
from gpu_backend.host.prepare import HostState, Prepared, complete, prepared_steps
from gpu_backend.host.truth import member, truth_shape, unique
from gpu_backend.replay.loop import GUARD_PAGES
from gpu_backend.trace import TraceData, load_trace
from sim.errors import TraceError

NAMES = ["default40", "big", *sorted(SCENARIOS), *FAULTS]
_PASSES = ("targets", "identity_group", "seq_lens", "rewind", "content", "pool_rows")


def _trace(tmp: Path, name: str) -> TraceData:
    return load_trace(named_trace(tmp, name, 9))


def _steps(trace: TraceData) -> list[tuple[Prepared, dict[str, np.ndarray]]]:
    slots, _, last = truth_shape(trace)
    state = HostState(trace, GUARD_PAGES, trace.model.max_position, last=last,
                      free=list(range(slots))[::-1],
                      graphs=Planner.for_model(trace.model, H200))
    out = []
    for p in prepared_steps(trace, state, "cpu", defer=True):
        complete(p)
        out.append((p, {k: p.dv[k].numpy().copy() for k in p.dv}))
    return out


def _counting(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    for name in _PASSES:
        fn = getattr(prepare_jit, name)

        def wrapped(*a: Any, _fn: Any = fn, _name: str = name) -> Any:
            calls[_name] += 1
            return _fn(*a)

        monkeypatch.setattr(prepare_jit, name, wrapped)
    return calls


_FIELDS = ("ops", "touched", "fill", "engine_nan", "truth_same", "q_identity", "groups",
           "wcheck", "graph")


@pytest.mark.parametrize("name", ["big", "clean_mtp", "shared_block_written", *FAULTS[:4]])
def test_every_step_split_across_threads_is_prepared_the_same(
        tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step's long passes split across 3 threads (`layout_jit.split`,
    `prepare_jit.content_split`: the split length at 1): the arrays, operations and groups of the
    preparation in one piece, and the split passes ran."""
    trace = _trace(tmp_path, name)
    # every step through `build_step` (a steady step's one call, `prepare`, never splits: it
    # takes steps of at most `prepare_jit.SMALL` appends, far below the split length)
    monkeypatch.setattr(prepare, "may", lambda *a: False)
    # the prompts' step's content inputs per token, as the split passes make them (else the
    # device makes them from its rows: `truth.row_content`)
    monkeypatch.setattr(truth_mod, "row_content", lambda *a: False)
    want = _steps(trace)
    monkeypatch.setattr(prepare_jit, "threads", lambda: 3)
    monkeypatch.setattr(prepare_jit, "SPLIT", 1)
    calls: Counter[str] = Counter()
    for mod, fn in ((layout_jit, "split"), (prepare_jit, "content_split")):
        real = getattr(mod, fn)

        def counted(*a: Any, _real: Any = real, _fn: str = fn, **kw: Any) -> Any:
            calls[_fn] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, fn, counted)
    got = _steps(trace)
    assert calls["split"] >= len(got) > 0 and calls["content_split"] > 0, calls
    for (p, a), (q, b) in zip(got, want, strict=True):
        assert sorted(a) == sorted(b), p.b.step
        assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k], equal_nan=True)
                   for k in a), p.b.step
        assert all(getattr(p, f) == getattr(q, f) for f in _FIELDS), p.b.step


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 1 << 21), st.integers(-3, 1 << 21)), max_size=40),
       st.lists(st.integers(0, 9), max_size=40), st.integers(0, 3), st.integers(1, 5))
def test_content_split_is_content(tp: list[tuple[int, int]], rope: list[int], shorter: int,
                                  parts: int) -> None:
    """`prepare_jit.content_split` in 1-5 parts against the one-pass `content`: tokens and RoPE
    positions past M and below 0 (taken mod M), query positions that differ from the truth's
    anywhere, or are shorter."""
    tok = np.array([t for t, _ in tp], dtype=np.int64)
    pos = np.array([p for _, p in tp], dtype=np.int64)
    rp = np.array(rope, dtype=np.int64)
    truth = rp.copy()
    if len(truth) and shorter == 1:
        truth[len(truth) // 2] += 1
    elif shorter == 2:
        truth = truth[: len(truth) // 2]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(prepare_jit, "threads", lambda: parts)
        got = prepare_jit.content_split(tok, pos, rp, truth, M)
    want = prepare_jit.content(tok, pos, rp, truth, M)
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(got[:2], want[:2],
                                                                            strict=True))
    assert got[2:] == want[2:]


def test_the_big_trace_takes_every_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark's steady MTP steps take the identity group and rewind their drafts (in
    `prepare`'s own way: `steady_jit`'s and `prepare_jit`'s passes call them compiled, past these
    counters)."""
    monkeypatch.setattr(prepare, "may", lambda *a: False)
    monkeypatch.setattr(prepare_jit, "pool_ops", lambda *a: None)
    calls = _counting(monkeypatch)
    _steps(_trace(tmp_path, "big"))
    assert all(calls[n] > 0 for n in _PASSES), calls


_pages = st.integers(-3, 40)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_pages, st.booleans()), max_size=40),
       st.one_of(st.none(), st.lists(_pages, min_size=1, max_size=12)),
       st.lists(_pages, max_size=12), st.integers(0, 42))
def test_targets_are_the_numpy_targets_and_blame(apps: list[tuple[int, bool]],
                                                 touched: list[int] | None,
                                                 allowed: list[int], pages: int) -> None:
    """`prepare_jit.targets` against `truth._numpy_targets` + `_blameless`' numpy, on drawn writes
    (wild ones below 0 and past the pool included), touched pages and allowed pages."""
    ew = np.array([e for e, _ in apps], dtype=np.int64)
    ok = np.array([o for _, o in apps], dtype=bool)
    allow = unique(np.array(allowed, dtype=np.int64)).astype(np.int32)
    tset = None if touched is None else unique(np.array(touched, dtype=np.int64))
    w = unique(ew[(ew >= 0) & (ew < pages)])
    if tset is None:
        want_w, want_n = w, len(w)
    else:
        hit = member(w, tset)
        want_w, want_n = np.concatenate([w[~hit], w[hit]]), int((~hit).sum())
    wrong = unique(ew[~ok])
    want_ok = member(want_w, np.sort(allow.astype(np.int64)))
    if len(wrong):
        want_ok &= ~member(want_w, wrong)
    got_w, got_n, got_ok = prepare_jit.targets(ew, pages, np.zeros(0, np.int64) if tset is None
                                         else tset, tset is not None, allow, ok)
    assert got_n == want_n and np.array_equal(got_w, want_w) and np.array_equal(got_ok, want_ok)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 300)), min_size=1, max_size=20),
       st.integers(1, 8))
def test_the_identity_groups_numbers_are_numpys(rows: list[tuple[int, int]], W: int) -> None:
    committed = np.array([c for c, _ in rows], dtype=np.int64)
    slots = np.array([s for _, s in rows], dtype=np.int64)
    limit, consecutive, top, low = prepare_jit.identity_group(committed, slots, W)
    want = committed[:, None] + np.arange(W)[None, :]
    assert limit.dtype == want.dtype and np.array_equal(limit, want)
    assert consecutive == (len(slots) == 1 or bool((np.diff(slots) == 1).all()))
    assert (top, low) == (int(committed.max()) + W, int(want.min()) + 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 40), max_size=40), st.booleans())
def test_distinct_is_np_unique_in_order_or_not(xs: list[int], in_order: bool) -> None:
    # values already in order skip the sort (a prompts' step's own pages): the same answer
    x = np.array(sorted(xs) if in_order else xs, dtype=np.int64)
    assert prepare_jit.distinct(x).tolist() == np.unique(x).tolist()
    assert prepare_jit.distinct(x[::2]).tolist() == np.unique(x[::2]).tolist()  # a strided view


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 16)), max_size=20),
       st.sampled_from([1, 3, 16]))
def test_seq_lens_are_flashinfers(rows: list[tuple[int, int]], B: int) -> None:
    indptr = np.concatenate([[0], np.cumsum([n for n, _ in rows])]).astype(np.int32)
    last = np.array([x for _, x in rows], dtype=np.int32)
    want = np.maximum(np.diff(indptr) - 1, 0) * B + last
    got = prepare_jit.seq_lens(indptr, last, B)
    assert got.dtype == want.dtype and np.array_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(16, 4000), st.integers(0, 15)), min_size=1, max_size=30))
def test_the_rewinds_rows_and_pages_are_numpys(slots: list[tuple[int, int]]) -> None:
    page = np.array([p for p, _ in slots], dtype=np.int64)
    slot = np.array([s for _, s in slots], dtype=np.int64)
    rows, pages = prepare_jit.rewind(page, slot, 16)
    base = page * 2 * 16 + slot
    assert np.array_equal(rows, np.concatenate([base, base + 16]))
    assert pages.dtype == page.dtype and np.array_equal(pages, unique(page))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4000), max_size=30), st.sampled_from([2, 32]),
       st.lists(st.integers(0, 10**6), max_size=20))
def test_the_pool_rows_of_poisoned_pages_are_numpys(pages: list[int], rows: int,
                                                     lead: list[int]) -> None:
    p = np.array(pages, dtype=np.int64)
    ahead = np.array(lead, dtype=np.int64)
    want = np.concatenate([ahead, (p[:, None] * rows + np.arange(rows)).ravel()])
    got = prepare_jit.pool_rows(p, rows, ahead)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_row_whose_lengths_contradict_itself_is_refused_as_before(tmp_path: Path) -> None:
    """`TraceData.checked` leaves out a step with a row whose RoPE positions do not fit its
    queries: preparing it still raises `layout._check_lengths`' error, and the steps around it
    are checked once, when the trace loads."""
    bld = Builder()
    bld.request(1, prompt(1, 20))
    bld.step([bld.ctx(1)])
    bld.step([bld.gen(1, 3, 1)])
    bad = bld.gen(1, 3, 2)
    bld.step([replace(bad, rope_pos=bad.rope_pos[:-1])])
    trace = load_trace(bld.write(tmp_path / "t", "bad_lengths"))
    assert trace.checked == {0, 1}
    with pytest.raises(TraceError, match="do not fit q_len 4"):
        _steps(trace)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 5000)), max_size=12))
def test_token_rows_is_its_numpy(rows: list[tuple[int, int]]) -> None:
    """`prepare_jit.token_rows` against `layout.prompts_batch`'s numpy: each token's row and
    committed + j, rows of any length (none too)."""
    q_len = np.array([q for q, _ in rows], dtype=np.int64)
    committed = np.array([c for _, c in rows], dtype=np.int64)
    row, true_pos = prepare_jit.token_rows(q_len, committed)
    qo = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int64)
    want_row = np.repeat(np.arange(len(q_len), dtype=np.int32), q_len)
    want_pos = np.arange(int(qo[-1]), dtype=np.int64) + np.repeat(committed - qo[:-1], q_len)
    assert row.dtype == np.int32 and true_pos.dtype == np.int64
    assert np.array_equal(row, want_row) and np.array_equal(true_pos, want_pos)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 700), st.integers(1, 40), st.booleans()),
                min_size=1, max_size=300),
       st.booleans(), st.integers(0, 700), st.booleans())
def test_a_long_steps_numpy_targets_are_the_compiled_passs(
        runs: list[tuple[int, int, bool]], in_order: bool, pages: int, some_touched: bool) -> None:
    """A step past `prepare_jit.SMALL` appends takes numpy's way (`truth.targets`: its runs first,
    no sort where the pages come in order): the same answer as the compiled pass, whose own
    oracle is the plain numpy above, with its pages in order (a prompts' step's) or not."""
    from types import SimpleNamespace

    from gpu_backend.host import truth as truth_mod

    if in_order:
        runs = sorted(runs)
    n = [k for _, k, _ in runs]
    ew = np.repeat(np.array([e for e, _, _ in runs], dtype=np.int64), n)
    ok = np.repeat(np.array([o for _, _, o in runs]), n)
    times = prepare_jit.SMALL // len(ew) + 1  # past SMALL: the runs again, in order when they were
    ew = np.sort(np.tile(ew, times)) if in_order else np.tile(ew, times)
    ok = np.tile(ok, times)
    allow = unique(ew[(ew >= 0) & (ew % 3 != 0)]).astype(np.int32)
    tset = unique(ew[ew % 5 == 0]) if some_touched else None
    b = SimpleNamespace(engine_write=ew, allowed_pages=allow, write_ok=ok)
    got = truth_mod.targets(b, pages, tset)  # type: ignore[arg-type]
    want = prepare_jit.targets(ew, pages, np.zeros(0, np.int64) if tset is None else tset,
                         tset is not None, allow, ok)
    assert len(ew) > prepare_jit.SMALL and got[1] == want[1]
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[2], want[2])
