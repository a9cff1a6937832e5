"""`kvsim sweep SWEEP.toml --out DIR`: a grid of scenarios (× max-QPS search), cached by content.
Prints the answer (one row per grid point), then where the files went."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from sim.cli.common import console, err_console, user_errors

if TYPE_CHECKING:
    import pyarrow as pa

    from sim.sweep.spec import SweepSpec


def sweep(sweep_file: Annotated[Path, typer.Argument(help="Sweep TOML file (docs/capacity.md).")],
          out: Annotated[str, typer.Option("--out", "-o", help="Folder for results.parquet, "
                                           "sweep.png and the cache: a new path, or an earlier "
                                           "sweep's (resumed; --force: afresh).")],
          workers: Annotated[int, typer.Option(help="Local processes (0: one per CPU).")] = 0,
          address: Annotated[str | None, typer.Option(
              help="A running Ray cluster's HOST:PORT: run the points there.")] = None,
          force: Annotated[bool, typer.Option("--force", help="Start --out afresh when it "
                                              "holds an earlier kvsim sweep.")] = False,
          synthetic_workload: Annotated[bool, typer.Option(
              "--synthetic-workload", help="Run the base scenario's workload.trace.fallback "
              "(a synthetic stand-in) instead of its trace file.")] = False,
          ) -> None:
    """Run every grid point (with a search section, the max QPS under the SLO of each); print
    one row per point; write DIR/results.parquet (every metric of every point) and
    DIR/sweep.png."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from sim.cli.options import check_workers
    from sim.outputs import Kind, Plan, check_out
    from sim.sweep import load_sweep, run_sweep

    with user_errors():
        plan = check_out(out, Kind.SWEEP, force)  # before any work
        check_workers(workers)
        spec, base = load_sweep(sweep_file)
        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), transient=True,
                      console=err_console) as bar:
            tid = bar.add_task("grid points", total=len(spec.points()))
            res = run_sweep(spec, base, Path(out), workers=workers, address=address,
                            on_done=lambda done, _: bar.update(tid, completed=done),
                            fresh=plan is Plan.REPLACE, synthetic_workload=synthetic_workload)
    console.print(answer_table(res.results, spec))
    typer.echo(f"{Path(out) / 'results.parquet'}: {res.results.num_rows} points, "
               f"{res.computed} simulations run, {res.cached} cached, {res.seconds:.1f} s")
    if res.plot is not None:
        typer.echo(f"{res.plot}")
    for note in res.notes:
        typer.echo(note, err=True)


def _num(v: object) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:,.2f}" if abs(v) >= 1 else f"{v:.3g}"
    return str(v)


def _qps(row: dict, spec: SweepSpec) -> str:
    assert spec.search is not None
    if row["search_capped"]:
        return f"≥ {_num(row['max_qps'])}"  # the SLO held at the top of the search range
    if row["max_qps"] == 0:
        return f"< {_num(spec.search.lo)}"  # it failed at the bottom of the range
    return _num(row["max_qps"])


def answer_table(results: pa.Table, spec: SweepSpec) -> Table:
    """One row per grid point: its grid values, then the answer (max QPS under the SLO with a
    search, else goodput or throughput), then the SLO's metrics and output tok/s there."""
    slo = spec.slo.targets()
    title = ("max QPS under SLO" if spec.search else "sweep") + f" · {spec.slo}"
    t = Table(title=title, title_justify="left")
    keys = list(spec.grid)
    for k in keys:
        t.add_column(k, no_wrap=True, min_width=len(k))
    if spec.search is not None:
        t.add_column("max QPS", justify="right", style="bold")
    else:
        t.add_column("goodput (req/s)" if slo else "throughput (req/s)", justify="right")
    shown = [s.key for s in slo] or ["ttft_p99_ms", "tpot_p99_ms"]
    for k in shown:
        metric, stat, _ = k.split("_")
        t.add_column(f"{metric.upper()} {stat} (ms)", justify="right")
    t.add_column("finished", justify="right")
    t.add_column("output tok/s", justify="right")
    for r in results.to_pylist():
        cells = [str(r[f"grid.{k}"]) for k in keys]
        if spec.search is not None:
            cells.append(_qps(r, spec))
        else:
            cells.append(_num(r["goodput_rps" if slo else "throughput_rps"]))
        cells += [_num(r[k]) for k in shown]
        cells += [f"{r['finished']}/{r['requests']}", _num(r["output_tps"])]
        t.add_row(*cells)
    return t


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep)
