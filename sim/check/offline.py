"""Re-check a trace on disk: read it, replay its records through StepChecker, finish."""

from __future__ import annotations

from pathlib import Path

from sim.check.checker import StepChecker
from sim.trace.reader import iter_records, read_trace
from sim.trace.records import BlockEvent, Violation


def check_trace(path: str | Path) -> list[Violation]:
    """All violations the records of the trace at `path` show. Raises TraceError if unreadable."""
    trace = read_trace(path)
    checker = StepChecker(trace.manifest["model"])
    out: list[Violation] = []
    for item in iter_records(trace):
        if isinstance(item, BlockEvent):
            out += checker.block_event(item)
        else:
            out += checker.launch(*item)
    return out + checker.finish()
