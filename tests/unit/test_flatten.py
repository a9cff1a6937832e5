"""The compiled flattening (`gpu_backend.host.layout_jit`) against the numpy one it replaced
(`layout.flat_numpy`): the same arrays, dtypes included, on random rows (wild positions,
tables too short, shared pages, device-ahead appends) and on every step of the replay
scenarios and the fault catalog's traces."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replay_traces import FAULTS, SCENARIOS, any_trace

from gpu_backend.host import layout_jit, prepare_jit
from gpu_backend.host.batch import _FIELDS, StepBatch, _runs
from gpu_backend.host.layout import (
    _FLAT,
    TAIL,
    _flat_compiled,
    _flat_indices,
    _steady_runs,
    build_step,
)
from gpu_backend.host.layout import flat_numpy as _flat_numpy
from gpu_backend.trace import load_trace


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    for k in _FLAT:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].tolist() == b[k].tolist(), k


@st.composite
def _rows(draw: st.DrawFn) -> tuple[dict[str, np.ndarray], int, int, np.ndarray]:
    B, guard = draw(st.sampled_from([1, 2, 3, 4])), draw(st.integers(1, 3))  # 3: no shift
    R = draw(st.integers(1, 5))
    ints = st.integers(-3, 14)

    def per_row(s: st.SearchStrategy[int]) -> np.ndarray:
        return np.array(draw(st.lists(s, min_size=R, max_size=R)), dtype=np.int64)

    def lists(lens: np.ndarray, s: st.SearchStrategy[int]) -> np.ndarray:
        n = int(lens.sum())
        return np.array(draw(st.lists(s, min_size=n, max_size=n)), dtype=np.int64)

    c = {"q_len": per_row(st.integers(0, 4)), "committed": per_row(st.integers(0, 12)),
         "shared_blocks": per_row(st.integers(0, 3)), "new_tokens": per_row(st.integers(0, 4)),
         "is_gen": np.array(draw(st.lists(st.booleans(), min_size=R, max_size=R))),
         "alloc_len": per_row(st.integers(0, 6)), "pages_len": per_row(st.integers(0, 6))}
    # device-ahead extras, or none: every row's appends its queries (`layout_jit.run`'s `same`)
    c["append_pos_len"] = c["q_len"] + (per_row(st.integers(0, 2)) if draw(st.booleans()) else 0)
    if draw(st.booleans()):
        c["append_pos"] = lists(c["append_pos_len"], st.integers(-5, 40))
    else:  # each row at consecutive positions from its own start (`layout_jit.rows` takes such a
        # run a table entry and a truth block at once: their edges need not line up), one moved
        at = per_row(st.integers(-5, 20))
        c["append_pos"] = np.concatenate([np.zeros(0, np.int64)] + [
            x + np.arange(n, dtype=np.int64) for x, n in zip(at, c["append_pos_len"], strict=True)])
        if len(c["append_pos"]) and draw(st.booleans()):
            c["append_pos"][draw(st.integers(0, len(c["append_pos"]) - 1))] += \
                draw(st.sampled_from([-1, 1, 7]))
    c["tokens"] = lists(c["append_pos_len"], st.integers(0, 99))
    c["rope_pos"] = lists(c["q_len"], st.integers(0, 40))
    c["alloc"] = lists(c["alloc_len"], ints)
    c["pages"] = lists(c["pages_len"], ints)
    # the trace's indptr need not be the pages' offsets (a wrong one is a fault to replay)
    c["kv_indptr"] = np.cumsum(c["pages_len"]) - c["pages_len"] + per_row(st.integers(-2, 2))
    shared = np.array(sorted(set(draw(st.lists(ints, max_size=4)))), dtype=np.int64)
    return c, B, guard, shared


@settings(max_examples=400, deadline=None)
@given(_rows(), st.sampled_from(["fa2", "xqa"]))
def test_the_compiled_pass_gives_the_numpy_arrays(case: tuple[dict[str, np.ndarray], int, int,
                                                              np.ndarray], backend: str) -> None:
    c, B, guard, shared = case
    indptr, ind = _flat_indices(c, backend)
    _same(_flat_compiled(c, indptr, ind, shared, B, guard),
          _flat_numpy(c, indptr, ind, shared, B, guard))


@pytest.mark.parametrize("name", [*sorted(SCENARIOS), *FAULTS])
def test_every_step_flattens_the_same_compiled(tmp_path: Path, name: str) -> None:
    t = load_trace(any_trace(tmp_path, name))
    pages = sorted({p for rows in t.rows.values() for r in rows for p in r.alloc if p >= 0})
    for i, s in enumerate(t.steps):
        rows = t.rows[s.step]
        if not rows:
            continue
        shared = np.array(pages[i % 3::3], dtype=np.int64)  # some pages shared, varying
        args = (s, rows, t.model.page_size, 16, shared, t.columns.get(s.step))
        fast, slow = build_step(*args), build_step(*args, compiled=False)
        for k, v in vars(slow).items():
            got = getattr(fast, k)
            assert (got.dtype, got.tolist()) == (v.dtype, v.tolist()) \
                if isinstance(v, np.ndarray) else got == v, k


def _args(c: dict[str, np.ndarray], B: int, guard: int, shared: np.ndarray,
          backend: str) -> tuple[Any, ...]:
    indptr, ind = _flat_indices(c, backend)
    return (c["q_len"], c["append_pos_len"], c["append_pos"], c["rope_pos"], c["tokens"],
            c["committed"], c["alloc"], c["alloc_len"], c["shared_blocks"], c["is_gen"],
            c["new_tokens"], indptr, ind, np.sort(shared), B, guard, TAIL)


def _equal(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> None:
    assert len(a) == len(b) == len(_FLAT)
    for k, x, y in zip(_FLAT, a, b, strict=True):
        assert (x.dtype, x.tolist()) == (y.dtype, y.tolist()), k


@settings(max_examples=300, deadline=None)
@given(_rows(), st.sampled_from(["fa2", "xqa"]), st.integers(1, 6))
def test_the_threaded_pass_gives_the_one_pass_arrays(
        case: tuple[dict[str, np.ndarray], int, int, np.ndarray], backend: str,
        parts: int) -> None:
    c, B, guard, shared = case
    args = _args(c, B, guard, shared, backend)
    _equal(layout_jit.split(parts, *args), layout_jit.flatten(*args))


@settings(max_examples=300, deadline=None)
@given(_rows(), st.sampled_from(["fa2", "xqa"]), st.integers(1, 6))
def test_the_layouts_pass_gives_the_one_pass_arrays(
        case: tuple[dict[str, np.ndarray], int, int, np.ndarray], backend: str,
        parts: int) -> None:
    """`layout_jit.run`, in one call or split, gives `layout_jit`'s arrays; where every row's
    appends
    are its queries, three of them are its inputs (tokens, rope_pos) and row_of_token."""
    c, B, guard, shared = case
    args = _args(c, B, guard, shared, backend)
    with mock.patch.object(prepare_jit, "parts", lambda n: parts):
        got = layout_jit.run(*args)
    _equal(got, layout_jit.flatten(*args))
    if np.array_equal(c["q_len"], c["append_pos_len"]):
        assert got[4] is c["tokens"] and got[6] is c["rope_pos"] and got[5] is got[2]


@pytest.mark.parametrize("name", ["clean_mtp", "shared_block_written", "append_past_alloc",
                                  "overlap_uncorrected"])
def test_a_long_step_is_split_across_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             name: str) -> None:
    """A scenario's longest steps through `build_step` with the split threshold at 1 and 3
    threads, some pages shared: the arrays of the one pass (and the split really ran)."""
    t = load_trace(any_trace(tmp_path, name))
    pages = sorted({p for rows in t.rows.values() for r in rows for p in r.alloc if p >= 0})
    calls: list[int] = []
    real = layout_jit.split

    def split(parts: int, *args: Any, **kw: Any) -> tuple[np.ndarray, ...]:
        calls.append(parts)
        return real(parts, *args, **kw)

    monkeypatch.setattr(layout_jit, "split", split)
    monkeypatch.setattr(prepare_jit, "threads", lambda: 3)
    longest = sorted((s for s in t.steps if t.rows[s.step]),
                     key=lambda s: -sum(len(r.append_pos) for r in t.rows[s.step]))[:4]
    for i, s in enumerate(longest):
        shared = np.array(pages[i % 3::3], dtype=np.int64)
        args = (s, t.rows[s.step], t.model.page_size, 16, shared, t.columns.get(s.step))
        monkeypatch.setattr(prepare_jit, "SPLIT", 1 << 30)
        one = build_step(*args)
        monkeypatch.setattr(prepare_jit, "SPLIT", 1)
        split = build_step(*args)
        for k, v in vars(one).items():
            got = getattr(split, k)
            assert (got.dtype, got.tolist()) == (v.dtype, v.tolist()) \
                if isinstance(v, np.ndarray) else got == v, k
    assert calls == [3] * len(longest) and longest


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=6))
def test_the_steady_run_is_found_as_runs_finds_it(rows: list[tuple[bool, int]]) -> None:
    """`_steady_runs` (a compiled look for one width) gives `_runs`' runs: no rows, context
    rows, mixed widths, decode (1) and verify widths, empty queries."""
    is_ctx = np.array([c for c, _ in rows], dtype=bool)
    q_len = np.array([q for _, q in rows], dtype=np.int64)
    assert _steady_runs({"is_ctx": is_ctx, "q_len": q_len}) == _runs(is_ctx, q_len)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_built_step_has_every_field_of_its_dataclass_in_order(tmp_path: Path,
                                                                 compiled: bool) -> None:
    """`build_step` makes a StepBatch without its __init__ (one dict of every field): the
    same fields, in the dataclass's order, each of the type its annotation says, and equal to
    the batch its __init__ makes from them."""
    t = load_trace(any_trace(tmp_path, "clean_mtp"))
    for s in [x for x in t.steps if t.rows[x.step]][:3]:
        b = build_step(s, t.rows[s.step], t.model.page_size, 16, compiled=compiled)
        assert list(vars(b)) == list(_FIELDS)
        for f in fields(StepBatch):
            want = np.ndarray if f.type == "np.ndarray" else \
                {"int": int, "str": str}.get(str(f.type), tuple)
            assert isinstance(getattr(b, f.name), want), f.name
        made = StepBatch(**vars(b))
        assert all(getattr(made, k) is getattr(b, k) for k in _FIELDS)
