"""Stray pool writes for the page watch's tests (tests/unit/test_watch.py, tests/gpu): each case
is a (trace, step, page) that only one of IncrementalWatch's checks can see."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from replay_traces import SCENARIOS

from gpu_backend.host.prepare import HostState, prepared_steps
from gpu_backend.host.truth import truth_shape
from gpu_backend.replay.loop import GUARD_PAGES
from gpu_backend.trace import TraceData, load_trace

CASES = ("ahead", "target", "pool")


class Stray:
    """`inner` kernels (either backend), plus one write to pool page `page` after step `at`'s
    kernels: a kernel writing where the engine's metadata did not aim it."""

    def __init__(self, inner: Any, at: int, page: int):
        self.inner, self.at, self.page = inner, at, page
        self.name = inner.name

    def run_step(self, pool: Any, b: Any, *a: Any) -> Any:
        out = self.inner.run_step(pool, b, *a)
        if b.step == self.at:
            pool.data[self.page, 0, 0] = 0.25  # neither NaN (poison) nor content's bits
        return out


def _steps(trace: TraceData) -> list[tuple[int, set[int], set[int]]]:
    """(step, pages its events touch, pages its appends target) of each step with rows."""
    slots, _, last = truth_shape(trace)
    st = HostState(trace, GUARD_PAGES, trace.model.max_position, last=last,
                   free=list(range(slots))[::-1])
    out = []
    for p in prepared_steps(trace, st, "cpu"):
        touched = set(p.dv["touched"].tolist()) if p.touched else set()
        out.append((p.b.step, touched, set(p.wpages.tolist())))
    return out


def pick(trace: TraceData, case: str) -> tuple[int, int] | None:
    """(step, page) for a stray write that only `case`'s check can see."""
    steps = _steps(trace)
    for i, (k, _, aimed) in enumerate(steps[:-1]):
        nxt_touched = steps[i + 1][1]
        if case == "ahead":  # the next step's events rewrite it: checked just before them
            for page in sorted(nxt_touched - aimed):
                return k, page
        if case == "target":  # a later step's append aims at it, no event touches it before
            seen: set[int] = set()
            for _, touched, later in steps[i + 1:]:
                seen |= touched
                for page in sorted(later - aimed - seen):
                    return k, page
                seen |= later
    if case == "pool":  # a guard page: only the whole-pool check reads it
        return steps[len(steps) // 2][0], 1
    return None


def find_case(tmp: Path, case: str) -> tuple[TraceData, tuple[int, int]]:
    """The first replay trace offering `case`, and its (step, page)."""
    for name in ("clean_mtp", "clean_decode", "append_past_alloc", "shared_block_written"):
        trace = load_trace(SCENARIOS[name](tmp / name))
        at = pick(trace, case)
        if at is not None:
            return trace, at
    raise AssertionError(f"no replay trace offers a page for {case!r}")
