"""check_trace_compiled: a trace directory on disk through the compiled checker.

The rows table is fed one Arrow record batch at a time, zero-copy (its list columns are the
bulk of a trace: ~300M page ids for workload (a)); steps and events, much smaller, are
converted once and sliced to follow. A step whose rows straddle two record batches is put
together by the driver (CompiledChecker.feed_batch).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from sim.check.compiled.batch import Batch
from sim.check.compiled.columns import Events, Steps, events_of, rows_of, steps_of
from sim.check.compiled.driver import CompiledChecker, Triple, sorted_steps


def _columns(table: pa.Table | pa.RecordBatch) -> dict[str, object]:
    return {name: table.column(name) for name in table.column_names}


def check_trace_compiled(path: str | Path) -> list[Triple]:
    """The (invariant, step, request) of every violation sim.check.offline.check_trace finds
    in the trace at `path`, in its order. Raises TraceError if unreadable."""
    from sim.trace.reader import read_trace

    trace = read_trace(path)
    t = trace.tables
    ck = CompiledChecker(trace.manifest["model"])
    steps, events = sorted_steps(steps_of(_columns(t["steps"]))), events_of(_columns(t["blocks"]))
    s0 = e0 = 0
    for rb in t["rows"].to_batches():
        if not rb.num_rows:
            continue
        rows = rows_of(_columns(rb))
        last = rows.step[-1]  # this batch's steps and events: up to its last row's step
        s1 = int(np.searchsorted(steps.step, last, "right"))
        e1 = int(np.searchsorted(events.step, last, "right"))
        ck.feed_batch(Batch(_part(steps, s0, s1), rows, _part(events, e0, e1)))
        s0, e0 = s1, e1
    rest = rows_of({})
    ck.feed_batch(Batch(_part(steps, s0, len(steps.step)), rest,
                        _part(events, e0, len(events.step))))
    return ck.finish()


def _part(cols: Steps | Events, lo: int, hi: int):  # type: ignore[no-untyped-def]
    return type(cols)(*(a[lo:hi] for a in cols))
