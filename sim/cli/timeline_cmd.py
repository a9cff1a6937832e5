"""`kvsim timeline TRACE_DIR --out FILE.json`: Chrome trace-event JSON for Perfetto."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sim.errors import KvsimError


def timeline(trace_dir: Annotated[Path, typer.Argument(help="trace directory")],
             out: Annotated[Path, typer.Option("--out", "-o", help="JSON file to write")]) -> None:
    """Host and device lanes (overlap), per-request spans and KV counters, for ui.perfetto.dev."""
    from sim.timeline import trace_timeline

    if not out.parent.is_dir():
        typer.echo(f"error: {out}: folder {out.parent} does not exist", err=True)
        raise typer.Exit(2)
    try:
        n = trace_timeline(trace_dir, out)
    except KvsimError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{out}: {n} events")


def register(app: typer.Typer) -> None:
    app.command("timeline")(timeline)
