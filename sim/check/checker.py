"""StepChecker: every invariant of docs/design.md §3.7 that records can show, composed.

Call order, identical online (fed by the engine) and offline (fed by `iter_records`):

    for each iteration k:
        block_event(e) for e in k's "sched" events      (seq order)
        launch(step k, rows of k)                      (rows complete: `accepted` known)
        block_event(e) for e in k's "proc" events      (a "done" event with src=j marks the
                                                        host processing step j: not in flight)
    finish()
"""

from __future__ import annotations

from collections.abc import Sequence

from sim.check.content import SlotModel
from sim.check.layout import check_layout
from sim.check.ownership import Ownership
from sim.check.plans import check_plans
from sim.check.positions import check_host_width, check_positions
from sim.check.registry import LAUNCH_ORDER
from sim.check.view import Model, StepView
from sim.trace.records import BlockEvent, RowRecord, StepRecord, Violation

_RANK = {inv: i for i, inv in enumerate(LAUNCH_ORDER)}


class StepChecker:
    """Incremental invariant checker. Each call returns the violations it found, in order."""

    def __init__(self, model: dict) -> None:
        """`model`: the manifest "model" dict (tokens_per_block, num_blocks, null_block, ...)."""
        self.m = Model.from_dict(model)
        self.own = Ownership(self.m)
        self.slots = SlotModel(self.m)
        self.last_step = -1

    def block_event(self, ev: BlockEvent) -> list[Violation]:
        if ev.event == "done":  # the host starts applying step `src`: no longer in flight
            self.own.mark_processing(ev.src)
            return []
        self.slots.event(ev)
        return self.own.event(ev)

    def launch(self, step: StepRecord, rows: Sequence[RowRecord]) -> list[Violation]:
        v = StepView(step, rows, self.m)
        out = (check_plans(step, rows, self.m.plan_cache_limit) + check_host_width(v, self.m)
               + self.own.launch(v)
               + check_layout(v, self.m, self.own.refcount) + check_positions(v)
               + self.slots.launch(v))
        self.own.mark_launched(v)
        self.last_step = step.step
        out.sort(key=lambda x: _RANK.get(x.invariant, len(_RANK)))
        return out

    def finish(self) -> list[Violation]:
        """End of run: every request freed, the pool idle."""
        return self.own.finish(self.last_step)
