"""A prompts' step's content inputs made from its rows (`truth.row_content`,
`staging.FromRows`, `prepare_jit.row_positions`): the same values as the per-token arrays they stand
for, and the per-token path wherever they do not follow from the rows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from replay_traces import named_trace
from test_defer import _state, _steps

from gpu_backend.device.pool import M, mod_m
from gpu_backend.host import prepare_jit
from gpu_backend.host.layout import prompts_batch, token_rows
from gpu_backend.host.prepare import prepared_steps
from gpu_backend.host.staging import F64, I32, I64, Chunk, FromRows, stage
from gpu_backend.host.truth import row_content
from gpu_backend.replay.loop import GUARD_PAGES
from gpu_backend.trace import TraceData, load_trace


def _oracle(tokens: np.ndarray, rope: np.ndarray, q_len: np.ndarray, committed: np.ndarray
            ) -> int:
    qo = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int64)
    if len(tokens) != len(rope) or len(tokens) != qo[-1]:
        return -1
    true_pos = np.arange(int(qo[-1])) + np.repeat(committed - qo[:-1], q_len)
    ok = np.array_equal(rope, true_pos) and ((tokens >= 0) & (tokens < M)).all() and \
        ((rope >= 0) & (rope < M)).all()
    return int(rope.max(initial=-1)) if ok else -1


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3000)), max_size=8),
       st.integers(0, 5), st.sampled_from([0, 1, -1, M, M - 1, 7]))
def test_row_positions_is_its_numpy(rows: list[tuple[int, int]], bad_at: int, value: int
                                    ) -> None:
    """`prepare_jit.row_positions` against numpy: the largest position when every row's are
    committed + j and every token and position is in [0, M), else -1; rows of any length (none
    too), with one token or position drawn off."""
    q_len = np.array([q for q, _ in rows], dtype=np.int64)
    committed = np.array([c for _, c in rows], dtype=np.int64)
    _, rope = prepare_jit.token_rows(q_len, committed)
    tokens = (np.arange(len(rope), dtype=np.int64) * 7919) % 50_000
    for t, r in ((tokens, rope), (_set(tokens, bad_at, value), rope),
                 (tokens, _set(rope, bad_at, value)), (tokens[:-1], rope)):
        assert prepare_jit.row_positions(t, r, q_len, committed, M) == \
            _oracle(t, r, q_len, committed)


def _set(a: np.ndarray, i: int, v: int) -> np.ndarray:
    a = a.copy()
    if len(a):
        a[i % len(a)] = v
    return a


def _trace(tmp: Path) -> TraceData:
    return load_trace(named_trace(tmp, "big", 6))


def _first_columns(trace: TraceData, **change: Any) -> TraceData:
    """The trace with its first step's columns changed (`change`: column -> function of it)."""
    s = trace.steps[0].step
    cols = dict(trace.columns[s])
    for k, f in change.items():
        cols[k] = f(cols[k])
    return replace(trace, columns={**trace.columns, s: cols})


def test_from_rows_gives_the_per_token_arrays(tmp_path: Path) -> None:
    """On the CPU, every array `FromRows` makes is the staged per-token one, by value, dtype
    and form (I64 the float64's bits, F64 the float64, I32 the int32)."""
    trace = _trace(tmp_path)
    st_ = _state(trace, together=True)
    s = trace.steps[0]
    thin = prompts_batch(s, trace.columns[s.step], trace.model.page_size, GUARD_PAGES,
                         per_token=False)
    assert thin is not None
    slots = np.arange(thin.num_rows, dtype=np.int64)[::-1].copy() + 3
    made: dict[str, np.ndarray] = {}
    assert row_content(st_, thin, slots, made) and set(made) == {"ptok", "prow"}
    whole = token_rows(thin)
    want = {"app_tok_m": mod_m(whole.tokens), "app_pos_m": mod_m(whole.rope_pos),
            "tslot": np.repeat(slots, whole.q_len), "true_pos": whole.true_pos}
    chunk = Chunk("cpu")
    dv = stage(chunk, made)
    ref = stage(chunk, want)
    chunk.upload()
    got = FromRows(dv.chunk, dv.slots)
    ref = type(ref)(chunk, ref.slots)
    assert sorted(got) == sorted(FromRows.MADE) and len(got) == len(FromRows.MADE)
    for k in FromRows.MADE:
        forms = [I64, F64] if k.endswith("_m") else [I64, I32]
        for f in forms:
            a, b = got.view(k, f), ref.view(k, f)
            assert a.dtype == b.dtype and torch.equal(a, b), (k, f)
    with pytest.raises(KeyError):
        got.view("tslot", F64)


@pytest.mark.parametrize("change", [
    {"rope_pos": lambda r: r + 1},  # the engine's positions are not the truth's
    {"tokens": lambda t: _set(t, 5, M)},  # a token past M: mod M changes it
    {"tokens": lambda t: _set(t, 0, -1)},
])
def test_what_does_not_follow_from_the_rows_is_staged_per_token(
        tmp_path: Path, change: dict[str, Any]) -> None:
    """Such a prompts' step takes the per-token arrays (`content_arrays`), and its deferred
    replay is still the undeferred one, array for array."""
    trace = _first_columns(_trace(tmp_path), **change)
    p = next(prepared_steps(trace, _state(trace), "cpu", defer=True))
    assert p.deferred is not None and not isinstance(p.dv, FromRows)
    assert p.b.true_pos is not None  # `token_rows` made them
    _same(trace)


def test_a_step_past_the_rope_table_is_staged_per_token(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    top = int(trace.columns[trace.steps[0].step]["rope_pos"].max())
    trace = replace(trace, model=replace(trace.model, max_position=top))
    p = next(prepared_steps(trace, _state(trace), "cpu", defer=True))
    assert not isinstance(p.dv, FromRows) and p.engine_nan
    _same(trace)


def _same(trace: TraceData) -> None:
    want, got = _steps(trace, False), _steps(trace, True)
    for (p, a), (q, b) in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a), p.b.step
        assert p.truth_same == q.truth_same and p.engine_nan == q.engine_nan
