"""`truthprep.truth_shape` against its definition, written out row by row, on every replay test
trace: the truth store's slots (the most requests live at one step, a request live from its
first row's step to its last's), its span (the most keys a row reaches) and each request's last
step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from replay_traces import FAULTS, SCENARIOS, named_trace

from gpu_backend.tracedata import TraceData, load_trace
from gpu_backend.truthprep import truth_shape

NAMES = ["default40", "big", *sorted(SCENARIOS), *FAULTS]


def _definition(trace: TraceData) -> tuple[int, int, dict[int, int]]:
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    span = 1
    for step in sorted(trace.rows):
        for r in trace.rows[step]:
            first.setdefault(r.request, step)
            last[r.request] = step
            span = max(span, r.committed + r.q_len)
    steps = sorted(trace.rows)
    live = [sum(first[q] <= s <= last[q] for q in first) for s in steps]
    return max([1, *live]), span, last


@pytest.mark.parametrize("name", NAMES)
def test_truth_shape_is_its_definition(tmp_path: Path, name: str) -> None:
    trace = load_trace(named_trace(tmp_path, name, 9))
    slots, span, last = truth_shape(trace)
    want = _definition(trace)
    assert (slots, span, last) == want
    assert list(last) == sorted(last)  # by request, as the free list's order expects


def test_a_request_away_for_a_step_keeps_its_slot() -> None:
    """A request's rows need not be in consecutive steps: it stays live (its slot kept) from
    its first row's step to its last's. Request 1 at steps 0 and 2, requests 2 and 3 at step 1
    alone: three slots (two if 1 gave its slot up while away)."""
    def row(req: int, committed: int, q_len: int) -> SimpleNamespace:
        return SimpleNamespace(request=req, committed=committed, q_len=q_len)

    rows = {0: [row(1, 0, 5)], 1: [row(2, 0, 7), row(3, 0, 9)], 2: [row(1, 5, 1)]}
    cols = {s: {"request": np.array([r.request for r in rs], np.int64),
                "committed": np.array([r.committed for r in rs], np.int64),
                "q_len": np.array([r.q_len for r in rs], np.int64)} for s, rs in rows.items()}
    trace = SimpleNamespace(rows=rows, columns=cols)
    got = truth_shape(trace)  # type: ignore[arg-type]
    assert got == _definition(trace) == (3, 9, {1: 2, 2: 1, 3: 1})  # type: ignore[arg-type]
