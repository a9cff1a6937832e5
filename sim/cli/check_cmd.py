"""`kvsim check TRACE_DIR`: re-check every invariant offline, from the trace alone."""

from __future__ import annotations

from pathlib import Path

import typer

from sim.cli.common import console, user_errors
from sim.cli.options import check_count
from sim.cli.report import result_json

# Judged by the engine while it runs (they need its admission and host-side state, which the
# trace does not carry); offline, the check reports what the trace recorded for them.
ENGINE_SIDE = ("I18", "HOST", "LIVENESS")


def register(app: typer.Typer) -> None:
    app.command("check")(check_cmd)


def check_cmd(
    trace: Path = typer.Argument(..., help="Trace directory written by `kvsim run --out`."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object, "
                                 "the shape `kvsim run --json` prints (docs/checking.md)."),
    limit: int = typer.Option(20, help="Violations to print (text mode)."),
    reference: bool = typer.Option(
        False, "--reference",
        help="Check with the Python StepChecker alone (the oracle, much slower) instead of "
             "the compiled checker, which words what it finds through StepChecker anyway."),
) -> None:
    """Re-check a trace. Exit 0: clean; 1: violations; 2: not a readable, complete trace."""
    from sim.check.compiled import check_trace_compiled
    from sim.check.offline import check_trace
    from sim.check.registry import causal_key
    from sim.trace.reader import read_trace, records

    with user_errors():
        check_count(limit, "--limit")
        # the compiled checker finds the same (invariant, step, request) as StepChecker in a
        # fraction of the time; only a trace with violations pays for StepChecker's messages
        found = check_trace(trace) if reference or check_trace_compiled(trace) else []
        tr = read_trace(trace)
        recorded = [v for v in records(tr, "violations") if v.invariant in ENGINE_SIDE]
    found = sorted(found + recorded, key=causal_key)  # as `run` lists them: root cause first
    if as_json:  # the run's summary as recorded, with the violations found now
        summary = dict(tr.manifest.get("summary", {})) | {"violations": len(found),
                                                           "workload": tr.manifest.get("workload")}
        typer.echo(result_json("check", trace, summary, found))
    else:
        for v in found[:limit]:
            console.print(v.message, highlight=False, soft_wrap=True)
        if len(found) > limit:
            console.print(f"... and {len(found) - limit} more")
        console.print(f"{trace}: {len(found)} violation(s)", highlight=False)
    raise typer.Exit(1 if found else 0)
