"""A step's block events as pool operations in one compiled pass, for the usual generation
step: its events poison or keep pages, no block is shared or copied, no free is a double free.

Why: `events.event_ops` walks a 64 x 2k generation step's ~10 events in Python, then
`poolops.join_rewind` turns the poisoned pages into pool rows behind the last step's rewound
slots: ~12 µs of a ~75 µs preparation on a development machine, ~35 on the H200's host.
Here that is one call. `event_ops` and `join_rewind` stay as the oracle: tests/unit/
test_eventsk.py holds every step of the replay test traces to them (the ops, their arrays,
the touched pages, the shared blocks after).
"""

from __future__ import annotations

import numpy as np

from gpu_backend.events import PoolOp
from gpu_backend.tracedata import EVENT_CODES, EventColumns, TraceData
from sim.jit_cache import drop_stale

drop_stale(__file__)

import numba as nb  # noqa: E402

from gpu_backend.prepk import pool_rows  # noqa: E402

_ALLOC, _COPY, _EVICT, _DONE = (EVENT_CODES.index(e) for e in ("alloc", "copy", "evict", "done"))
_NONE = np.zeros(0, dtype=np.int64)
_EMPTY = EventColumns(_NONE, _NONE, _NONE, _NONE, _NONE, _NONE)


def pool_ops(trace: TraceData, step: int, guard: int, late: list[int], shared: set[int],
             rewind: tuple[np.ndarray, np.ndarray] | None, arrays: dict[str, np.ndarray]
             ) -> tuple[list[PoolOp], np.ndarray] | None:
    """What `poolops.join_rewind(event_ops(...))` makes of step `step`'s events (after launch
    step - 1, before launch step) and `late` (the in-flight poison before it), behind the last
    step's `rewind` (rows, pages): (ops, touched pages), the poisoned rows in `arrays`, and
    `shared` kept. None, nothing changed: an event copies a slot or leaves a block shared
    (the trace's double frees are the caller's to rule out: `events.InFlight`)."""
    a = trace.event_columns.get((step - 1, "proc"), _EMPTY)
    b = trace.event_columns.get((step, "sched"), _EMPTY)
    lead, pages = rewind if rewind is not None else (_NONE, _NONE)
    rows, touched, n = _pass(a.code, a.block, a.refcount, a.src, b.code, b.block, b.refcount,
                             b.src, np.asarray(late, dtype=np.int64), guard,
                             2 * trace.model.page_size, lead, pages)
    if n < 0:
        return None
    if shared:  # every block an event names has one holder or none now
        for c in (a, b):
            shared.difference_update(c.block[c.code != _DONE].tolist())
    if n:
        arrays["ev0"] = rows
        return [("nan", 0, 0, 0)], touched
    if rewind is None:
        return [], touched
    arrays["ev-1"] = rows
    return [("nan", -1, 0, 0)], touched


@nb.njit(cache=True)
def _pass(code_a, block_a, count_a, src_a, code_b, block_b, count_b, src_b, late, guard,
          rows, lead, lead_pages):  # pragma: no cover  (compiled; its oracle is `event_ops`)
    """(the pool rows: `lead`, then each poisoned page's `rows`, the touched pages (the
    poisoned ones in order, then `lead_pages`), how many pages are poisoned), or n = -1 when
    an event copies a slot or leaves its block shared."""
    pages = np.empty(len(code_a) + len(code_b) + len(late), np.int64)
    n = _poisoned(code_a, block_a, count_a, src_a, guard, pages, 0)
    if n >= 0:
        n = _poisoned(code_b, block_b, count_b, src_b, guard, pages, n)
    if n < 0:
        return pool_rows(pages[:0], rows, lead), pages[:0], -1
    for blk in late:
        pages[n] = blk + guard
        n += 1
    touched = np.empty(n + len(lead_pages), np.int64)
    touched[:n] = pages[:n]
    touched[n:] = lead_pages
    return pool_rows(pages[:n], rows, lead), touched, n


@nb.njit(cache=True)
def _poisoned(code, block, count, src, guard, pages, n):  # pragma: no cover  (compiled)
    """The pool indices of the pages these events poison (alloc, evict) into pages[n:], in
    order; returns the new n, or -1 when one copies a slot or leaves its block shared."""
    for i in range(len(code)):
        k = code[i]
        if k == _DONE:
            continue
        if count[i] > 1 or (k == _COPY and src[i] >= 0):
            return -1
        if k == _ALLOC or k == _EVICT:
            pages[n] = block[i] + guard
            n += 1
    return n
