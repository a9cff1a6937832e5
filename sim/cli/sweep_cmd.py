"""`kvsim sweep SWEEP.toml --out DIR`: a grid of scenarios (× max-QPS search), cached by content."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sim.errors import KvsimError


def sweep(sweep_file: Annotated[Path, typer.Argument(help="sweep TOML")],
          out: Annotated[str, typer.Option("--out", "-o", help="results folder: a new path, or "
                                           "an earlier sweep's (resumed; --force: afresh)")],
          workers: Annotated[int, typer.Option(help="local processes (0: one per CPU)")] = 0,
          address: Annotated[str | None, typer.Option(
              help="a running Ray cluster's HOST:PORT: run the points there")] = None,
          force: Annotated[bool, typer.Option("--force", help="Start --out afresh when it "
                                              "holds an earlier kvsim sweep.")] = False,
          synthetic_workload: Annotated[bool, typer.Option(
              "--synthetic-workload", help="run the base scenario's workload.trace.fallback "
              "(a synthetic stand-in) instead of its trace file")] = False,
          ) -> None:
    """Run every grid point; write DIR/results.parquet (one row per point) and DIR/sweep.png."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from sim.cli.options import check_workers
    from sim.outputs import Kind, Plan, check_out
    from sim.sweep import load_sweep, run_sweep

    try:
        plan = check_out(out, Kind.SWEEP, force)  # before any work
        check_workers(workers)
        spec, base = load_sweep(sweep_file)
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), transient=True) as bar:
            tid = bar.add_task("grid points", total=len(spec.points()))
            res = run_sweep(spec, base, Path(out), workers=workers, address=address,
                            on_done=lambda done, _: bar.update(tid, completed=done),
                            fresh=plan is Plan.REPLACE, synthetic_workload=synthetic_workload)
    except KvsimError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{Path(out) / 'results.parquet'}: {res.results.num_rows} points, "
               f"{res.computed} simulations run, {res.cached} cached, {res.seconds:.1f} s")
    if res.plot is not None:
        typer.echo(f"{res.plot}")
    for note in res.notes:
        typer.echo(note, err=True)


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep)
