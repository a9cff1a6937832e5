"""gpu_backend/device/watch.py: the incremental page watch ends in FullWatch's verdicts, whatever
wrote
where: nothing unseen (the same rows, no second replay), or a page changed that no append aimed
at, caught by each of its three checks and replayed with the full watch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from replay_traces import SCENARIOS
from watch_cases import CASES, Stray, find_case

from gpu_backend.device.pool import KVPool
from gpu_backend.device.watch import FullWatch, IncrementalWatch, written
from gpu_backend.replay import loop
from gpu_backend.replay.cpu import ReferenceKernels
from gpu_backend.replay.loop import replay
from gpu_backend.trace import TraceData, load_trace
from gpu_backend.verdicts import ReplayResult


def _rows(res: ReplayResult) -> list[tuple[Any, ...]]:
    return [(r.step, r.row, r.request, r.verdict, r.err, r.message) for r in res.rows]


def _replay(trace: TraceData, watch: str, kernels: Any = None) -> ReplayResult:
    m = trace.model
    return replay(trace, kernels or ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu",
                  watch=watch)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_incremental_gives_the_full_watch_verdicts(tmp_path: Path, name: str) -> None:
    trace = load_trace(SCENARIOS[name](tmp_path / name))
    full, inc = _replay(trace, "full"), _replay(trace, "incremental")
    assert (full.watch, inc.watch) == ("full", "incremental")  # appends wrote only where aimed
    assert _rows(inc) == _rows(full)


@pytest.mark.parametrize("case", CASES)
def test_a_page_changed_where_no_append_aimed_is_found_and_replayed_in_full(
        tmp_path: Path, case: str) -> None:
    """Each case is seen by one check alone (`watch_cases.pick`): without it the expected sum
    would take the stray bits in silently, and the step that wrote them would not be blamed."""
    trace, at = find_case(tmp_path, case)
    m = trace.model
    full = _replay(trace, "full", Stray(ReferenceKernels(m.num_q_heads, m.num_blocks), *at))
    inc = _replay(trace, "incremental",
                  Stray(ReferenceKernels(m.num_q_heads, m.num_blocks), *at))
    assert inc.watch.startswith("full (incremental found a page changed outside")
    assert _rows(inc) == _rows(full)
    assert {r.verdict for r in full.rows if r.step == at[0]} == {"corrupt"}


@pytest.mark.parametrize("every", [{"SEND_TOKENS": 1}, {"EARLY": 1},
                                   {"EARLY": 3, "FLUSH": 5}])
@pytest.mark.parametrize("case", [None, *CASES])
def test_read_backs_after_every_step_change_nothing(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   case: str | None,
                                                   every: dict[str, int]) -> None:
    """The driver reads verdict data back every EARLY steps or SEND_TOKENS query tokens (a long
    prompt step alone) and waits for all of it every FLUSH steps: wherever the read-backs and
    the waits fall, the same rows in the same order, and a stray write still sends the replay
    to the full watch."""
    trace, at = (load_trace(SCENARIOS["append_past_alloc"](tmp_path / "t")), None) \
        if case is None else find_case(tmp_path, case)
    m = trace.model

    def kernels() -> Any:
        k = ReferenceKernels(m.num_q_heads, m.num_blocks)
        return k if at is None else Stray(k, *at)

    want = _replay(trace, "incremental", kernels())
    for name, n in every.items():
        monkeypatch.setattr(loop, name, n)
    got = _replay(trace, "incremental", kernels())
    assert _rows(got) == _rows(want) and got.watch == want.watch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("pages", "guard", "page_size", "heads", "dim"),
                         [(1, 0, 1, 1, 4), (9, 2, 16, 2, 8), (40, 16, 4, 1, 128)])
def test_a_fresh_pools_sums_are_its_whole_checksum(dtype: torch.dtype, pages: int, guard: int,
                                                  page_size: int, heads: int, dim: int) -> None:
    """`KVPool.fresh_checksum` (the watch's first sums, without reading the pool) is the whole
    pool's checksum while nothing has written it, and a tensor of its own the watch updates."""
    pool = KVPool(pages, guard, page_size, heads, dim, dtype, "cpu")
    got = pool.fresh_checksum()
    assert got.tolist() == pool.checksum().tolist() and got.is_contiguous()
    got[0] += 1  # a broadcast view of one page's sum would refuse the write
    assert got[0] != pool.checksum()[0] and pool.fresh_checksum()[0] == pool.checksum()[0]


@pytest.mark.parametrize("watch", ["incremental", "full"])
def test_a_fresh_pools_first_look_before_its_kernels_reads_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, watch: str) -> None:
    """On a pool nothing has written, a first step whose events apply no op (its new pages need
    no poison) leaves every sum as made: the watch looks at its pages without a read
    (`watch.written`), and at every later step's as before; the rows are the same."""
    trace = load_trace(SCENARIOS["clean_mtp"](tmp_path / "t"))  # later steps rewind drafts
    want = _replay(trace, watch)
    looked: list[int] = []
    for name in ("resum_pre", "resum"):
        real = getattr(KVPool, name)

        def spy(self: KVPool, *a: Any, _real: Any = real) -> Any:
            looked.append(len(looked))
            return _real(self, *a)

        monkeypatch.setattr(KVPool, name, spy)
    steps: list[tuple[bool, bool]] = []  # (pages to look at, a read)
    real_after = (IncrementalWatch if watch == "incremental" else FullWatch).after_events

    def after(self: Any, p: Any) -> None:
        n = len(looked)
        real_after(self, p)
        pages = bool(p.touched) or (watch == "incremental" and len(p.wpages) > 0)
        steps.append((pages, len(looked) > n))

    monkeypatch.setattr(IncrementalWatch if watch == "incremental" else FullWatch,
                        "after_events", after)
    got = _replay(trace, watch)
    assert _rows(got) == _rows(want) and got.watch == want.watch == watch
    assert steps[0] == (True, False) and len(steps) > 2
    assert all(read == pages for pages, read in steps[1:]) and any(r for _, r in steps[1:])


def test_a_pool_is_fresh_for_one_step_and_only_without_ops() -> None:
    """`written`: only the first step's events, and only with no op, leave the made pool's
    sums standing; any later step's kernels have run first."""
    pool = KVPool(4, 1, 2, 1, 4, torch.bfloat16, "cpu")
    no_ops, copy = SimpleNamespace(ops=[]), SimpleNamespace(ops=[("copy", 2, 3, 1)])
    for kind in (IncrementalWatch, FullWatch):
        w = kind(pool, fresh=True)
        assert not written(w, no_ops) and written(w, no_ops)
        w = kind(pool, fresh=True)
        assert written(w, copy) and written(w, no_ops)
        assert written(kind(pool), no_ops)  # sums from a look: no freshness claimed
