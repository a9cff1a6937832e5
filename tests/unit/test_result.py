"""The verdicts as arrays (`verdicts.judge`, `verdicts.ReplayResult`): the same rows, codes and
counts as judging each row by itself."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from replay_traces import FAULTS, SCENARIOS, fault_trace

from gpu_backend.host.batch import StepBatch
from gpu_backend.host.layout import build_step
from gpu_backend.replay.run import from_json, run_replay, to_json
from gpu_backend.trace import load_trace
from gpu_backend.verdicts import MISMATCH, NAN, OK, ReplayResult, judge


def _row_by_row(b: StepBatch, tok: np.ndarray, tol: float) -> tuple[list[int], list[float]]:
    """The definition, one row and one token at a time: a row is nan if some token's output
    is NaN where its reference is not, else mismatch if its largest finite error is over tol."""
    codes, errs = [], []
    for r in range(b.num_rows):
        mine = [t for t in range(b.num_tokens) if b.row_of_token[t] == r]
        e = [float(tok[0, t]) for t in mine if not math.isnan(tok[0, t])]
        worst = min(max(e, default=0.0), float(np.finfo(np.float32).max))
        nan = any(math.isnan(tok[0, t]) and not math.isnan(tok[1, t]) for t in mine)
        codes.append(NAN if nan else MISMATCH if worst > tol else OK)
        errs.append(worst)
    return codes, errs


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_judging_steps_together_gives_each_rows_own_verdict(tmp_path: Path, name: str) -> None:
    t = load_trace(SCENARIOS[name](tmp_path / name))
    rng = np.random.default_rng(1)
    batches = [build_step(s, t.rows[s.step], t.model.page_size, 16)
               for s in t.steps if t.rows[s.step]]
    seen: set[int] = set()
    at = k = 0
    while at < len(batches):
        group = batches[at: at + int(rng.integers(1, 9))]  # as a read-back of 1..8 steps
        at += len(group)
        toks = []
        for b in group:
            tok = (rng.random((2, b.num_tokens)) * 0.04).astype(np.float32)
            for r in range(b.num_rows):  # one token of each row: as it is, or one of
                t = rng.choice(np.flatnonzero(b.row_of_token == r))
                what, k = k % 5, k + 1  # a NaN, a NaN in both, an inf, a large error
                if what == 1:
                    tok[0, t] = np.nan
                elif what == 2:
                    tok[:, t] = np.nan
                elif what == 3:
                    tok[0, t] = np.inf
                elif what == 4:
                    tok[0, t] = 0.5
            toks.append(tok)
        code, err = judge(group, np.concatenate(toks, 1), 0.05)
        want_code: list[int] = []
        want_err: list[float] = []
        for b, tok in zip(group, toks, strict=True):
            c, e = _row_by_row(b, tok, 0.05)
            want_code += c
            want_err += e
        assert code.tolist() == want_code
        assert err.tolist() == pytest.approx(want_err)
        seen |= set(want_code)
    assert seen == {OK, MISMATCH, NAN}


@pytest.mark.parametrize("fault", FAULTS[::3])
def test_a_result_reads_the_same_from_its_arrays_and_from_its_rows(tmp_path: Path,
                                                                  fault: str) -> None:
    """counts, ok and the largest ok error from the judged arrays equal those of the rows, and
    of the same result read back from its JSON (rows only, no arrays)."""
    res = run_replay(fault_trace(tmp_path, fault), "reference", 0.02)
    assert res.judged
    back = from_json(to_json(res))
    assert not back.judged
    assert back.rows == res.rows
    want = {v: sum(r.verdict == v for r in res.rows) for v in res.counts()}
    assert res.counts() == back.counts() == want
    assert res.ok == back.ok == all(r.verdict == "ok" for r in res.rows)
    assert to_json(back)["max_ok_err"] == to_json(res)["max_ok_err"]


def test_rows_are_built_once_and_follow_new_verdicts() -> None:
    from gpu_backend.verdicts import Judged
    from sim.trace.records import RowRecord

    def row(step: int) -> RowRecord:
        return RowRecord(step=step, row=0, request=7, phase="gen", q_len=1, draft_len=0,
                         first_gen=False, prev_in_flight=False, pages=(), kv_indptr=0,
                         last_page_len=1, kv_len=1, append_pos=(), rope_pos=(), cached_host=0,
                         kv_len_host=1, committed=1, alloc=(), reserved=0, shared_blocks=0,
                         tokens=(), accepted=0, new_tokens=1, prev_new_tokens=1, max_pos=1)

    res = ReplayResult("reference", "t", 0.02)
    res.judged.append(Judged([[row(0)]], np.array([OK]), np.zeros(1, np.float32)))
    first = res.rows
    assert res.rows is first and [r.verdict for r in first] == ["ok"]
    res.judged.append(Judged([[row(1)], [row(2)]], np.array([4, 4]),
                             np.full(2, np.nan, np.float32), {0: "wild", 1: "refused"}))
    assert [(r.step, r.verdict, r.message) for r in res.rows] == [
        (0, "ok", ""), (1, "fault", "wild"), (2, "fault", "refused")]
    assert res.counts()["fault"] == 2 and not res.ok


@pytest.mark.parametrize("name", sorted(SCENARIOS) + FAULTS)
def test_moved_pages_blame_a_row_exactly_when_some_is_not_blameless(tmp_path: Path,
                                                                    name: str) -> None:
    """`Prepared.wok` (the driver's shortcut past `verdicts.blame`): moved flags over the step's
    target pages blame some row if and only if one of them falls on a page not `wok`."""
    from replay_traces import any_trace

    from gpu_backend.host.prepare import HostState, prepared_steps
    from gpu_backend.host.truth import truth_shape
    from gpu_backend.replay.loop import GUARD_PAGES
    from gpu_backend.verdicts import blame

    t = load_trace(any_trace(tmp_path, name))
    slots, _, last = truth_shape(t)
    st = HostState(t, GUARD_PAGES, t.model.max_position, last=last,
                   free=list(range(slots))[::-1])
    rng = np.random.default_rng(2)
    both = [0, 0]
    for p in prepared_steps(t, st, "cpu"):
        for _ in range(4):
            m = rng.random(len(p.wpages)) < rng.choice([0.1, 0.5, 1.0])
            changed = np.zeros(t.model.num_blocks + 2 * GUARD_PAGES, dtype=bool)
            changed[p.wpages] = m
            suspect = bool((m & ~p.wok).any())
            assert blame(p.b, changed).any() == suspect
            both[suspect] += 1
    assert both[0]  # every trace has steps whose writes blame nobody


def test_a_row_without_query_tokens_is_ok_with_no_error() -> None:
    """`judge` reduces each row's run of tokens: a row with none (an empty run, first, inside
    or last) reads 0 and OK, and does not take its neighbour's tokens."""
    from types import SimpleNamespace

    a = SimpleNamespace(qo_indptr=np.array([0, 0, 2, 2, 3], np.int32))
    b = SimpleNamespace(qo_indptr=np.array([0, 1, 1], np.int32))
    tok = np.array([[0.01, 0.5, np.nan, 0.02], [0.1, 0.1, 0.1, 0.1]], np.float32)
    code, err = judge([a, b], tok, 0.05)  # type: ignore[list-item]
    assert code.tolist() == [OK, MISMATCH, OK, NAN, OK, OK]
    assert err.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0, 0.02, 0.0])
