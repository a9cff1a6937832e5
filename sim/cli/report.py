"""What `run`, `record` and `check` report: the one JSON shape of `--json` (docs/checking.md)
and the violations on screen."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from sim.trace.records import Violation


def _plain(v: object) -> object:
    return None if isinstance(v, float) and math.isnan(v) else v  # JSON has no NaN


def result_json(command: str, source: Path, summary: dict, violations: Iterable[Violation]
                ) -> str:
    """`{"command", "source", "summary": {...}, "violations": [{"step", "request",
    "invariant", "message"}, ...]}`; `source` is the scenario run or the trace checked."""
    return json.dumps({
        "command": command, "source": str(source),
        "summary": {k: _plain(v) for k, v in summary.items()},
        "violations": [{"step": v.step, "request": v.request, "invariant": v.invariant,
                        "message": v.message} for v in violations]}, indent=2)


def print_violations(console: Console, violations: list[Violation], limit: int) -> None:
    """The first `limit` violations, one line each, then how many more there are."""
    for v in violations[:limit]:
        console.print(f"[red]{escape(v.message)}[/]", highlight=False)
    if len(violations) > limit:
        console.print(f"... and {len(violations) - limit} more")
