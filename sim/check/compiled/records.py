"""Reference-engine records -> the columns CompiledChecker.feed takes.

The reference engine hands its sink one step at a time as records; converting a batch of
steps through Arrow (as the trace writer does) and checking it in one compiled call is several
times cheaper than StepChecker's numpy work per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from sim.check.compiled.columns import Rows, Steps
from sim.check.compiled.driver import CompiledChecker
from sim.trace.records import BlockEvent, RowRecord, StepRecord
from sim.trace.schema import SCHEMAS
from sim.trace.writer import to_arrow

Step = tuple[StepRecord, Sequence[RowRecord], Sequence[BlockEvent]]

# what rows_of reads: the scalar fields and the list columns (tokens: only its lengths)
_ROW_FIELDS = tuple(f for f in Rows._fields if not f.endswith("_off")
                    and f not in ("pages", "app", "rope", "alloc")) + (
    "pages", "append_pos", "rope_pos", "alloc", "tokens")
_EVENT_FIELDS = ("step", "phase", "seq", "event", "block", "request", "refcount", "src",
                 "num_tokens")


def _columns(table: str, recs: Sequence[object], names: Sequence[str]) -> dict[str, pa.Array]:
    schema = SCHEMAS[table]
    return {n: to_arrow([getattr(r, n) for r in recs], schema.field(n).type) for n in names}


def feed_records(ck: CompiledChecker, steps: Sequence[Step]) -> None:
    """Feed whole steps (each with every event emitted from its launch to the next one)."""
    if not steps:
        return
    rows = [r for _, rs, _ in steps for r in rs]
    events = [e for _, _, es in steps for e in es]
    ck.feed(_columns("steps", [s for s, _, _ in steps], Steps._fields),
            _columns("rows", rows, _ROW_FIELDS) if rows else {},
            _columns("blocks", events, _EVENT_FIELDS))
