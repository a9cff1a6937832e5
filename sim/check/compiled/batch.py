"""A batch of trace columns for one kernel call: steps, their rows, block events.

The driver keeps the part of a chunk it may not check yet (the last step and every event from
its step on: the next chunk can still bring that step's events) as a Batch, and merges it with
the next chunk. Only that small tail is ever copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.check.compiled import codes as cd
from sim.check.compiled.columns import (
    Events,
    Rows,
    Steps,
    concat_rows,
    slice_rows,
    sort_events,
    sort_rows,
)

Key = tuple[int, int, int]


@dataclass(frozen=True)
class Batch:
    steps: Steps
    rows: Rows
    events: Events

    @property
    def row_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """Rows [lo[i], hi[i]) of step i (rows are sorted by step)."""
        s = self.steps.step
        return (np.searchsorted(self.rows.step, s, "left").astype(np.int64),
                np.searchsorted(self.rows.step, s, "right").astype(np.int64))

    def first_key(self) -> Key | None:
        keys = []
        if len(self.steps.step):
            keys.append((int(self.steps.step[0]), cd.LAUNCH_RANK, 0))
        if len(self.events.step):
            e = self.events
            keys.append((int(e.step[0]), int(e.rank[0]), int(e.seq[0])))
        return min(keys) if keys else None

    def last_key(self) -> Key | None:
        keys = []
        if len(self.steps.step):
            keys.append((int(self.steps.step[-1]), cd.LAUNCH_RANK, 0))
        if len(self.events.step):
            e = self.events
            keys.append((int(e.step[-1]), int(e.rank[-1]), int(e.seq[-1])))
        return max(keys) if keys else None

    def precedes(self, other: Batch) -> bool:
        """Every item of self comes before every item of other (the usual case)."""
        a, b = self.last_key(), other.first_key()
        return a is None or b is None or a <= b

    def merged(self, other: Batch) -> Batch:
        """Both batches as one, re-sorted (stable: self's items first on equal keys)."""
        steps = Steps(*(np.concatenate([x, y]) for x, y in zip(self.steps, other.steps,
                                                                strict=True)))
        order = np.argsort(steps.step, kind="stable")
        events = Events(*(np.concatenate([x, y]) for x, y in zip(self.events, other.events,
                                                                 strict=True)))
        return Batch(Steps(*(a[order] for a in steps)), sort_rows(concat_rows(self.rows,
                                                                              other.rows)),
                     sort_events(events))

    def tail(self, next_event: int, next_step: int) -> Batch:
        """What is left from the cursors on, copied out of the chunk's buffers."""
        lo = int(self.row_ranges[0][next_step]) if next_step < len(self.steps.step) else None
        n = len(self.rows.step)
        rows = slice_rows(self.rows, lo if lo is not None else n, n)
        return Batch(Steps(*(a[next_step:].copy() for a in self.steps)), rows,
                     Events(*(a[next_event:].copy() for a in self.events)))
