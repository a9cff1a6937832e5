"""`kvsim timeline TRACE_DIR --out FILE.json`: Chrome trace-event JSON for Perfetto."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sim.errors import KvsimError


def timeline(trace_dir: Annotated[Path, typer.Argument(help="trace directory")],
             out: Annotated[str, typer.Option("--out", "-o", help="JSON file to write (a new "
                                              "path, or an earlier timeline with --force)")],
             force: Annotated[bool, typer.Option("--force", help="Replace --out when it is an "
                                                 "earlier kvsim timeline.")] = False) -> None:
    """Host and device lanes (overlap), per-request spans and KV counters, for ui.perfetto.dev."""
    from sim.outputs import Kind, check_out
    from sim.timeline import trace_timeline

    try:
        check_out(out, Kind.TIMELINE, force)  # before any work
        n = trace_timeline(trace_dir, Path(out))
    except KvsimError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{out}: {n} events")


def register(app: typer.Typer) -> None:
    app.command("timeline")(timeline)
