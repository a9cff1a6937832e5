"""Ownership invariants I1, I5, I6, I17 and POOL, from block events and launched rows.

The pool is rebuilt from events alone: `holders[b]` lists the live requests holding block b
(alloc sets it, reuse appends, free/rewind removes), so refcount == len(holders[b]) always.
A step is in flight from its launch until the iteration that processes it starts processing.
"""

from __future__ import annotations

import numpy as np

from sim.check.access import INVALID, Accesses
from sim.check.view import Model, StepView, ceil_div, first_in_row, row_violations, violation
from sim.trace.records import BlockEvent, RowRecord, StepRecord, Violation


class Ownership:
    def __init__(self, m: Model) -> None:
        self.m = m
        self.holders: list[list[int]] = [[] for _ in range(m.num_blocks)]
        self.refcount = np.zeros(m.num_blocks, np.int64)
        self.sole = np.full(m.num_blocks, -1, np.int64)  # the one holder, -1 if 0 or several
        self.inflight: dict[int, dict[int, RowRecord]] = {}  # step -> request -> row
        self.busy: dict[int, int] = {}  # request -> number of its steps in flight
        self.match: dict[int, int] = {}  # request -> reused tokens of its current admission
        self.step = -1

    # -- block events -----------------------------------------------------------------------
    def event(self, ev: BlockEvent) -> list[Violation]:
        b = ev.block
        if not 0 <= b < self.m.num_blocks:
            return [violation("POOL", ev.step, ev.request,
                              f"{ev.event} of block {b} outside [0, {self.m.num_blocks})")]
        out = self._apply(ev, self.holders[b])
        n = len(self.holders[b])
        self.refcount[b] = n
        self.sole[b] = self.holders[b][0] if n == 1 else -1
        if ev.refcount != n:
            out.append(violation("POOL", ev.step, ev.request, (
                f"{ev.event} of block {b} records refcount {ev.refcount} but {n} live "
                f"requests hold it {self.holders[b]}")))
        return out

    def _apply(self, ev: BlockEvent, held: list[int]) -> list[Violation]:
        if ev.event == "alloc":
            out = self._taken_from(ev, held, f"allocated to req {ev.request}")
            if self.m.null_block and ev.block == 0:
                out.append(violation("POOL", ev.step, ev.request, "null block 0 allocated"))
            held[:] = [ev.request]
            return out
        if ev.event == "reuse":
            held.append(ev.request)
        elif ev.event == "evict":
            return self._taken_from(ev, held, "evicted")
        elif ev.event in ("free", "rewind"):
            return self._release(ev, held)
        return []

    def _taken_from(self, ev: BlockEvent, held: list[int], what: str) -> list[Violation]:
        if not held:
            return []
        busy = [r for r in held if self.busy.get(r)]
        inv = "I17" if busy else "POOL"
        tail = f"; req {busy[0]} has a step in flight" if busy else ""
        return [violation(inv, ev.step, ev.request, (
            f"block {ev.block} {what} while held by requests {held} "
            f"(refcount {len(held)}){tail}"))]

    def _release(self, ev: BlockEvent, held: list[int]) -> list[Violation]:
        r, b = ev.request, ev.block
        if r not in held:
            inv = "I17" if ev.event == "free" else "POOL"
            return [violation(inv, ev.step, r, (
                f"{ev.event} of block {b} that req {r} does not hold (holders {held}): "
                f"freed twice?"))]
        held.remove(r)
        steps = self._inflight_using(r, b, whole=ev.event == "free")
        if not steps:
            return []
        return [violation("I17", ev.step, r, (
            f"{ev.event} of block {b} while step {steps[0]} using req {r} is in flight"))]

    def _inflight_using(self, r: int, b: int, whole: bool) -> list[int]:
        """In-flight steps of r (whole), or those of r that touch block b (rewind).

        A rewind after the launch of the next step is legal as long as that step's reach
        (committed + tokens written) stays inside the blocks r keeps.
        """
        B = self.m.B
        return [s for s, rows in self.inflight.items()
                if r in rows and (whole or b in self._reach(rows[r], B))]

    @staticmethod
    def _reach(row: RowRecord, B: int) -> tuple[int, ...]:
        n = ceil_div(row.committed + max(len(row.tokens), row.q_len), B)
        return row.alloc[:n]

    # -- launch -----------------------------------------------------------------------------
    def launch(self, v: StepView) -> list[Violation]:
        return (self.i1_reserved(v) + self.i5_pages(v) + self.i5_writes(v) + self.i6_shared(v)
                + self.i6_match(v) + self.pool_counts(v.step))

    def i1_reserved(self, v: StepView) -> list[Violation]:
        c, res = v.col["committed"], v.col["reserved"]
        q = np.maximum(v.col["q_len"], np.diff(v.lay.append_ptr))  # extra draft KV counts
        need = ceil_div(res, self.m.B)
        out = row_violations("I1", v, c + q > res, lambda r: (
            f"reservation C={res[r]} does not cover committed {c[r]} + {q[r]} written = "
            f"{c[r] + q[r]}"))
        return out + row_violations("I1", v, need > v.n_alloc, lambda r: (
            f"reserved {res[r]} slots need {need[r]} blocks (B={self.m.B}) but "
            f"{v.n_alloc[r]} are allocated"))

    def i5_pages(self, v: StepView) -> list[Violation]:
        row = np.repeat(np.arange(v.n), v.nb)
        col = np.arange(len(row)) - v.lay.pages_ptr[row]
        pg = v.lay.pages
        has = col < v.n_alloc[row]
        mine = np.full(len(row), -2, np.int64)
        mine[has] = v.alloc[v.alloc_ptr[row[has]] + col[has]]
        shown = pg != -1 if v.backend == "xqa" else np.ones(len(row), bool)  # xqa padding
        first = first_in_row(shown & (pg != mine), row, v.n)
        return row_violations("I5", v, first >= 0, lambda r: (
            f"page {pg[first[r]]} at ordinal {col[first[r]]} is not the request's block there "
            f"(alloc {v.alloc_of(r)})"))

    def i5_writes(self, v: StepView) -> list[Violation]:
        w = v.acc.writes
        ok = (w.flags & INVALID) == 0
        pg = np.where(ok, w.page, 0)
        excl = (self.refcount[pg] == 1) & (self.sole[pg] == v.col["request"][w.row])
        first = first_in_row(ok & ~excl, w.row, v.n)
        return row_violations("I5", v, first >= 0, lambda r: self._not_exclusive(w, first[r]))

    def _not_exclusive(self, w: Accesses, i: int) -> str:
        p = int(w.page[i])
        return (f"appends position {w.pos[i]} into page {p} slot {w.slot[i]}, which is not "
                f"exclusively its own (holders {self.holders[p]}, refcount {self.refcount[p]})")

    def i6_shared(self, v: StepView) -> list[Violation]:
        w = v.acc.writes
        col = w.pos // self.m.B
        first = first_in_row((col >= 0) & (col < v.col["shared_blocks"][w.row]), w.row, v.n)
        return row_violations("I6", v, first >= 0, lambda r: (
            f"appends position {w.pos[first[r]]} into shared read-only block ordinal "
            f"{col[first[r]]} (page {w.page[first[r]]}; shared_blocks "
            f"{v.col['shared_blocks'][r]})"))

    def i6_match(self, v: StepView) -> list[Violation]:
        """The prefix match never covers the last prompt token: match <= P - 1."""
        out = []
        for row in v.rows:
            if row.phase == "ctx":  # the first chunk of an admission starts at the match
                self.match.setdefault(row.request, row.committed)
                continue
            got = self.match.pop(row.request, None)
            prompt = row.committed  # the first generation row starts at the prompt boundary
            if got is not None and got > prompt - 1:
                out.append(violation("I6", v.step.step, row.request, (
                    f"reuse matched {got} tokens of a {prompt}-token prompt "
                    f"(at most {prompt - 1}: the last prompt token is recomputed)")))
        return out

    def pool_counts(self, s: StepRecord) -> list[Violation]:
        usable = self.m.num_blocks - int(self.m.null_block)
        used = int(np.count_nonzero(self.refcount))
        out = []
        if s.blocks_used + s.blocks_free != usable:
            out.append(violation("POOL", s.step, -1, (
                f"blocks_used {s.blocks_used} + blocks_free {s.blocks_free} != {usable}")))
        if s.blocks_used != used:
            out.append(violation("POOL", s.step, -1, (
                f"blocks_used {s.blocks_used} but block events leave {used} blocks held")))
        return out

    # -- in flight --------------------------------------------------------------------------
    def mark_launched(self, v: StepView) -> None:
        self.inflight[v.step.step] = {row.request: row for row in v.rows}
        for row in v.rows:
            self.busy[row.request] = self.busy.get(row.request, 0) + 1

    def mark_processing(self, step: int) -> None:
        """From here on the host applies `step`'s results: the device is done with it."""
        for r in self.inflight.pop(step, {}):
            self.busy[r] -= 1

    def finish(self, last_step: int) -> list[Violation]:
        left: dict[int, list[int]] = {}
        for b, held in enumerate(self.holders):
            for r in held:
                left.setdefault(r, []).append(b)
        out = [violation("I17", last_step, r, f"never freed: still holds blocks {bs}")
               for r, bs in sorted(left.items())]
        used = int(np.count_nonzero(self.refcount))
        if used:
            out.append(violation("POOL", last_step, -1,
                                 f"pool not idle at end of run: {used} blocks still held"))
        return out
