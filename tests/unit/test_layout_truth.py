"""`layout.truth_writes` and `batch._runs` against their definitions, written out row by row.
A row may write a page when it is one of the row's own blocks (past its shared prefix,
allocated, not shared). Launch runs are the maximal runs of rows of one kind."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.host.batch import _runs
from gpu_backend.host.layout import _ragged
from gpu_backend.host.layout import truth_writes as _truth_writes

B, GUARD = 4, 3


def _definition(c: dict[str, np.ndarray], row: np.ndarray, true_pos: np.ndarray,
                eng: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """write_ok as first written: every (row, own page) of the batch as a set, every write
    looked up in it."""
    own = {(r, int(a) + GUARD) for r, lst in enumerate(_lists(c))
           for i, a in enumerate(lst)
           if i >= c["shared_blocks"][r] and a >= 0 and a not in set(shared.tolist())}
    return np.array([e >= 0 and (int(r), int(e)) in own for r, e in zip(row, eng, strict=True)],
                    dtype=bool)


def _lists(c: dict[str, np.ndarray]) -> list[list[int]]:
    ends = np.cumsum(c["alloc_len"])
    return [c["alloc"][e - n: e].tolist() for e, n in zip(ends, c["alloc_len"], strict=True)]


@st.composite
def _steps(draw: st.DrawFn) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray,
                                    np.ndarray, np.ndarray]:
    pages = st.integers(-1, 12)
    allocs = draw(st.lists(st.lists(pages, max_size=6), min_size=1, max_size=5))
    R = len(allocs)
    c = {"alloc": np.array([a for lst in allocs for a in lst], dtype=np.int64),
         "alloc_len": np.array([len(lst) for lst in allocs], dtype=np.int64),
         "shared_blocks": np.array(draw(st.lists(st.integers(0, 3), min_size=R, max_size=R)),
                                   dtype=np.int64),
         "is_gen": np.array(draw(st.lists(st.booleans(), min_size=R, max_size=R))),
         "new_tokens": np.array(draw(st.lists(st.integers(0, 4), min_size=R, max_size=R)),
                                dtype=np.int64),
         "committed": np.array(draw(st.lists(st.integers(0, 20), min_size=R, max_size=R)),
                               dtype=np.int64)}
    n = np.array(draw(st.lists(st.integers(0, 5), min_size=R, max_size=R)), dtype=np.int64)
    row, j = _ragged(n)
    row = row.astype(np.int32)  # as build_step passes its app_row
    true_pos = c["committed"][row] + j
    # engine writes: mostly the page the truth names (as a correct engine), else anything
    truth = [allocs[r][p // B] + GUARD if p // B < len(allocs[r]) and allocs[r][p // B] >= 0
             else -1 for r, p in zip(row.tolist(), true_pos.tolist(), strict=True)]
    eng = np.array([t if draw(st.booleans()) else draw(st.integers(-1, 12 + GUARD))
                    for t in truth], dtype=np.int64)
    shared = np.array(sorted(set(draw(st.lists(st.integers(0, 12), max_size=4)))),
                      dtype=np.int64)
    return c, row, true_pos, eng, shared


@settings(max_examples=300, deadline=None)
@given(_steps())
def test_write_ok_is_the_rows_own_pages(case: tuple[dict[str, np.ndarray], np.ndarray,
                                                     np.ndarray, np.ndarray, np.ndarray]) -> None:
    c, row, true_pos, eng, shared = case
    _, write_ok, _, _ = _truth_writes(c, B, GUARD, row, true_pos, eng, shared)
    assert write_ok.tolist() == _definition(c, row, true_pos, eng, shared).tolist()


def _runs_by_row(is_ctx: list[bool], q_len: list[int]) -> list[tuple[int, int, str]]:
    """Launch runs as first written: walk the rows, extend the run while the kind stays."""
    out: list[tuple[int, int, str]] = []
    for i, (c, q) in enumerate(zip(is_ctx, q_len, strict=True)):
        k = "ctx" if c else ("decode" if q == 1 else "verify")
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], i + 1, k)
        else:
            out.append((i, i + 1, k))
    return out


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=12))
def test_launch_runs_are_the_rows_walked(rows: list[tuple[bool, int]]) -> None:
    is_ctx = [c for c, _ in rows]
    q_len = [q for _, q in rows]
    got = _runs(np.array(is_ctx, dtype=bool), np.array(q_len, dtype=np.int64))
    assert list(got) == _runs_by_row(is_ctx, q_len)
