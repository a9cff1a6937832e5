"""A step's pool operations before its kernels: the block events between the last launch and
this one (`events.event_ops`; the usual generation step's in one compiled pass, `eventsk`) and
the last step's rewind (its rejected drafts' slots), as runs of pool rows to poison and slot
copies (`driver._apply_events`, `graphs`' block)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gpu_backend import eventsk, prepk
from gpu_backend.events import InFlight, PoolOp, event_ops, fresh_pool
from gpu_backend.stepbatch import StepBatch
from sim.trace.records import StepRecord

if TYPE_CHECKING:
    from gpu_backend.prepare import HostState

_NONE = np.zeros(0, dtype=np.int64)


def step_ops(st: HostState, s: StepRecord, flight: InFlight, arrays: dict[str, np.ndarray]
            ) -> tuple[list[PoolOp], np.ndarray]:
    """The pool operations before step s's kernels and the pages they touch (`join_rewind`):
    the usual generation step's in one compiled pass (`eventsk`), else `event_ops`'."""
    if st.prev_step >= 0 and not flight.double_free:
        got = eventsk.pool_ops(st.trace, s.step, st.guard, flight.before_step.get(s.step, []),
                               st.shared, st.rewind, arrays)
        if got is not None:
            return got
    ops, touched = event_ops(st.trace, s.step, st.guard, None, flight, arrays, st.shared)
    if st.prev_step < 0:  # before `join_rewind` turns the dropped poison's pages into rows
        ops = fresh_pool(ops, arrays)
    return join_rewind(st, ops, touched, arrays)


def rewind(st: HostState, b: StepBatch) -> None:
    """The step's rejected-draft slots as pool rows, for the next step's `join_rewind`."""
    st.rewind = None
    if b.reject_page.size:
        st.rewind = prepk.rewind(b.reject_page, b.reject_slot, st.trace.model.page_size)


def join_rewind(st: HostState, ops: list[PoolOp], touched: np.ndarray,
              arrays: dict[str, np.ndarray]) -> tuple[list[PoolOp], np.ndarray]:
    """The pool operations before this step's kernels, in order: the last step's rewind (its
    rejected drafts' slots become poison: nothing reads the pool in between, and that step's
    checksums were taken before it), then the block events. Poisoned pages become their pool
    rows (`KVPool.poison_rows`), and the rewind joins the first run of poisoned pages, so a step
    usually poisons in one launch. Returns (ops, pages touched)."""
    rows, rew = 2 * st.trace.model.page_size, st.rewind
    for i, (kind, a, _, _) in enumerate(ops):
        if kind == "nan":
            # the rewind's rows first in the first run, in the same pass
            lead = rew[0] if rew is not None and i == 0 else _NONE
            arrays[f"ev{a}"] = prepk.pool_rows(arrays[f"ev{a}"], rows, lead)
    if rew is None:
        return ops, touched
    rej_rows, rej_pages = rew
    touched = np.concatenate([touched, rej_pages])
    if ops and ops[0][0] == "nan":  # the rewind's rows lead its first run (`prepk.pool_rows`)
        return ops, touched
    arrays["ev-1"] = rej_rows
    return [("nan", -1, 0, 0), *ops], touched
