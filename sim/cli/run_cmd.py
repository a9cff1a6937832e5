"""`kvsim run SCENARIO`: simulate, check every invariant online, optionally write a trace."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sim.cli.choices import Engine
from sim.cli.common import console, err_console, parse_switches, user_errors
from sim.cli.options import check_count, check_seed
from sim.cli.report import print_violations, result_json


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)


def run_cmd(
    scenario: Path = typer.Argument(..., help="Scenario TOML file (see scenarios/README.md)."),
    profile: str = typer.Option(None, "--profile", "-p",
                                help="Engine profile, e.g. trtllm-post-17264 or BASE+FAULT."),
    seed: int = typer.Option(None, "--seed", help="Override the scenario's seed."),
    out: str = typer.Option(None, "--out", "-o", help="Write the trace directory here (a new "
                            "path, or an earlier trace with --force)."),
    force: bool = typer.Option(False, "--force", help="Replace --out when it holds an earlier "
                               "kvsim trace."),
    switch: list[str] = typer.Option([], "--switch", "-s",
                                     help="Override one behaviour switch: NAME=VALUE."),
    no_check: bool = typer.Option(False, "--no-check",
                                  help="Skip the online invariant checks (capacity runs)."),
    engine: Engine = typer.Option(
        Engine.auto, "--engine", help="auto: the compiled fast engine where it models the "
        "scenario (no MTP, no overlap, no reuse, simple cost), else the reference engine; "
        "fast: require it; reference: the pure-Python engine (the oracle; same trace)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary and violations as "
                                 "one JSON object, the shape `kvsim check --json` prints."),
    synthetic_workload: bool = typer.Option(
        False, "--synthetic-workload", help="Run the scenario's workload.trace.fallback (a "
        "synthetic stand-in) instead of its trace file; the manifest and summary say so."),
    max_violations: int = typer.Option(10, help="Violations to print."),
) -> None:
    """Simulate a scenario. Exit 0: no invariant fired; 1: one did; 2: bad input."""
    from sim.api import load_scenario, run, switches_for
    from sim.errors import ProfileError
    from sim.outputs import Kind, check_out

    with user_errors():
        check_seed(seed)
        check_count(max_violations, "--max-violations")
        if out is not None:  # before any work: a refused --out costs nothing
            check_out(out, Kind.TRACE, force)
        trace = None if out is None else Path(out)
        sc, base = load_scenario(scenario)
        if seed is not None:
            sc = sc.model_copy(update={"seed": seed})
        overrides = parse_switches(switch)
        try:  # before anything is allocated or written, naming where the bad value came from
            switches_for(sc, profile, overrides)
        except ProfileError as e:
            where = "--profile/--switch" if profile or overrides else "profile/switches"
            raise ProfileError(f"{scenario}: {where}: {e}") from None
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                      TextColumn("{task.completed} steps"), TimeElapsedColumn(),
                      console=err_console, transient=True,
                      disable=as_json or not err_console.is_terminal) as bar:
            task = bar.add_task(f"simulating {scenario.name}", total=None)
            res = run(sc, out=trace, check=not no_check, profile=profile, switches=overrides,
                      base_dir=base, on_progress=lambda k: bar.update(task, completed=k),
                      engine=engine.value, collect=False,  # summary, violations, trace: no tables
                      synthetic_workload=synthetic_workload)
    if as_json:
        typer.echo(result_json("run", scenario, res.summary | {"workload": res.workload},
                               res.violations))
    else:
        _print(res, profile or sc.profile, max_violations)
    raise typer.Exit(1 if res.violations else 0)


def _source(w: dict) -> str:
    if w["source"] == "trace":
        return f"{w['format']} trace {w['path']} ({w['rows']} rows)"
    if "stand_in_for" in w:
        return f"synthetic, standing in for {w['stand_in_for']['path']}"
    return "synthetic" if w["source"] == "synthetic" else f"{w['requests']} explicit requests"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.2f}"


def _print(res, profile: str, limit: int) -> None:  # type: ignore[no-untyped-def]
    s = res.summary
    t = Table(title=f"kvsim run · {profile}", show_header=False, title_justify="left")
    rows = [
        ("engine", f"{s['engine']} · profile {s['profile']}"),
        ("requests", f"{s['requests']} ({s['finished']} finished, {s['rejected']} rejected)"),
        ("steps", f"{s['steps']}"),
        ("tokens", f"{s['prompt_tokens']} prompt ({s['reused_tokens']} reused), "
                   f"{s['output_tokens']} output"),
        ("acceptance", f"{s['acceptance_rate']:.3f} of drafts, "
                       f"{s['mean_accepted_len']:.2f} tokens/step"),
        ("peak KV", f"{s['peak_kv_blocks']} / {s['num_blocks']} blocks"),
        ("preemptions", f"{s['preemptions']}"),
        ("simulated time", f"{s['sim_time_ns'] / 1e9:.3f} s"),
        ("TTFT p50 / p99", f"{_ms(s['ttft_p50_ms'])} / {_ms(s['ttft_p99_ms'])} ms"),
        ("TPOT p50 / p99", f"{_ms(s['tpot_p50_ms'])} / {_ms(s['tpot_p99_ms'])} ms"),
        ("throughput", f"{_ms(s['throughput_rps'])} req/s, {_ms(s['output_tps'])} output "
                       "tok/s (simulated time)"),
        ("violations", f"{s['violations']}"),
        ("workload", _source(res.workload)),
    ]
    if res.trace_dir is not None:
        rows.append(("trace", str(res.trace_dir)))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    print_violations(console, res.violations, limit)
