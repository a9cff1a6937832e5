"""`kvsim sweep SWEEP.toml --out DIR`: a grid of scenarios (× max-QPS search), cached by content."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sim.errors import KvsimError


def sweep(sweep_file: Annotated[Path, typer.Argument(help="sweep TOML")],
          out: Annotated[Path, typer.Option("--out", "-o", help="results folder")],
          workers: Annotated[int, typer.Option(help="local processes (0: one per CPU)")] = 0,
          address: Annotated[str | None, typer.Option(help="Ray cluster address")] = None
          ) -> None:
    """Run every grid point; write DIR/results.parquet (one row per point) and DIR/sweep.png."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from sim.cli.options import check_workers
    from sim.sweep import load_sweep, run_sweep

    try:
        check_workers(workers)
        spec, base = load_sweep(sweep_file)
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), transient=True) as bar:
            tid = bar.add_task("grid points", total=len(spec.points()))
            res = run_sweep(spec, base, out, workers=workers, address=address,
                            on_done=lambda done, _: bar.update(tid, completed=done))
    except KvsimError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{out / 'results.parquet'}: {res.results.num_rows} points, "
               f"{res.computed} simulations run, {res.cached} cached, {res.seconds:.1f} s")
    if res.plot is not None:
        typer.echo(f"{res.plot}")


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep)
