"""CompiledChecker: StepChecker's verdicts as (invariant, step, request) triples, compiled.

The Python side only converts columns, sizes arrays and calls the kernel once per chunk
(plus a call per growth of a buffer); every step, row and event is handled in kernel.run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TypeVar

import numpy as np

from sim.check.compiled import codes as cd
from sim.check.compiled.batch import Batch
from sim.check.compiled.columns import (
    Events,
    Rows,
    Steps,
    concat_rows,
    events_of,
    rows_of,
    slice_rows,
    sort_rows,
    steps_of,
    view_rows,
)
from sim.check.compiled.inflight import persist
from sim.check.compiled.kernel import finish as finish_kernel
from sim.check.compiled.kernel import run
from sim.check.compiled.state import (
    C_B,
    C_NB,
    G_NV,
    grow_entries,
    grow_nodes,
    grow_out,
    grow_requests,
    grow_steps,
    model_cfg,
    new_out,
    new_own,
    new_slots,
)

Triple = tuple[str, int, int]
T = TypeVar("T", Steps, Rows, Events)
_NO_STOP = np.iinfo(np.int64).max
_NAMES = np.array(cd.INVARIANTS, dtype=object)


class CompiledChecker:
    """Fed chunks of trace columns in step order (see `feed`); `finish` gives every violation
    StepChecker would report on the same calls, in its order."""

    def __init__(self, model: dict) -> None:
        self.cfg = model_cfg(model)
        nb, b = int(self.cfg[C_NB]), int(self.cfg[C_B])
        self.own, self.slots, self.out = new_own(nb), new_slots(nb, b), new_out()
        self.held: Batch | None = None

    def feed(self, steps: Mapping[str, np.ndarray], rows: Mapping[str, object],
             blocks: Mapping[str, np.ndarray]) -> None:
        """One chunk (sim.fast.Chunk's columns, or Arrow columns of a trace's tables)."""
        self.feed_batch(Batch(sorted_steps(steps_of(steps)), rows_of(rows),
                              events_of(blocks)))

    def feed_batch(self, batch: Batch) -> None:
        """Check what can be checked. The last step and the events from its step on are held
        back: the next chunk may bring more of that step's events (or rows)."""
        held, self.held = self.held, None
        if held is not None:
            held, batch = _late_rows(held, batch)
            if not held.precedes(batch):
                batch, held = held.merged(batch), None  # interleaved (not seen in practice)
        if not len(batch.steps.step):  # nothing can be checked before a later launch
            self.held = batch if held is None else held.merged(batch)
            return
        if held is not None:
            self._check(held, _NO_STOP)
        self.held = self._check(batch, int(batch.steps.step[-1]))

    def finish(self) -> list[Triple]:
        if self.held is not None:
            self._check(self.held, _NO_STOP)
            self.held = None
        self.out = grow_out(self.out, int(self.own.g[G_NV]) + len(self.own.busy) + 1)
        finish_kernel(self.own, self.out, self.cfg)
        n = int(self.own.g[G_NV])
        return list(zip(_NAMES[self.out.code[:n]].tolist(), self.out.step[:n].tolist(),
                        self.out.request[:n].tolist(), strict=True))

    def _check(self, batch: Batch, stop: int) -> Batch:
        """Check every item of `batch` before step `stop`; returns the rest."""
        self._size_for(batch)
        lo, hi = batch.row_ranges
        cur = np.zeros(2, np.int64)
        steps, rows, events = (_read_only(batch.steps), _read_only(batch.rows),
                               _read_only(batch.events))
        widest = int((hi - lo).max(initial=0))
        per_step = cd.N_ROW_CHECKS * widest + 8
        scratch = np.zeros((2, widest), np.int64)
        while True:
            status = run(self.own, self.slots, self.out, self.cfg, steps, lo, hi, rows, events,
                         cur, stop, scratch)
            if status == cd.NEED_VIOLATIONS:
                self.out = grow_out(self.out, int(self.own.g[G_NV]) + per_step)
            elif status == cd.NEED_ENTRIES:
                self.own = grow_entries(self.own, int((hi - lo).max(initial=0)))
            else:
                break
        # entries still in flight point into this batch's alloc buffer: copy them out
        self.own = self.own._replace(reach=persist(self.own, rows.alloc))
        return batch.tail(int(cur[0]), int(cur[1]))

    def _size_for(self, batch: Batch) -> None:
        """Per-request and per-step arrays for the ids the batch uses, free holder nodes."""
        ev, rows, steps = batch.events, batch.rows, batch.steps
        reqs = np.concatenate([rows.request, ev.request])
        if len(reqs):
            self.own = grow_requests(self.own, int(reqs.min()), int(reqs.max()))
        if len(steps.step):
            if steps.step[0] < 0:
                raise ValueError(f"step {steps.step[0]} < 0: not a trace's step")
            self.own = grow_steps(self.own, int(steps.step[-1]) + 1)
        takes = int(np.count_nonzero((ev.event == cd.ALLOC) | (ev.event == cd.REUSE)))
        self.own = grow_nodes(self.own, takes)


def _read_only(cols: T) -> T:
    """Read-only views of every column: numba types a read-only array apart from a writable
    one, and Arrow's zero-copy arrays are read-only, so inputs are made uniformly read-only
    (one compiled variant, whichever source and path a column came through)."""
    views = []
    for a in cols:
        v = a.view()
        v.flags.writeable = False
        views.append(v)
    return type(cols)(*views)


def sorted_steps(steps: Steps) -> Steps:
    if np.all(np.diff(steps.step) >= 0):
        return steps
    order = np.argsort(steps.step, kind="stable")
    return Steps(*(a[order] for a in steps))


def _late_rows(held: Batch, batch: Batch) -> tuple[Batch, Batch]:
    """Rows of the held steps at the head of the next batch (a trace's record batches may
    split a step's rows) join them; the batch keeps a zero-copy view of the rest."""
    if not len(held.steps.step):
        return held, batch
    rows = batch.rows
    k = int(np.searchsorted(rows.step, held.steps.step[-1], "right"))
    if k == 0:
        return held, batch
    late = slice_rows(rows, 0, k)
    return (replace(held, rows=sort_rows(concat_rows(held.rows, late))),
            replace(batch, rows=view_rows(rows, k, len(rows.step))))
