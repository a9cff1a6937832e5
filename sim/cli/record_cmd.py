"""`kvsim record --engine vllm SCENARIO --out DIR`: the real engine's decisions as a trace."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from sim.cli.choices import RealEngine
from sim.cli.common import console, err_console, user_errors
from sim.cli.report import print_violations, result_json

if TYPE_CHECKING:
    from sim.engines.record import Recorded


def register(app: typer.Typer) -> None:
    app.command("record")(record_cmd)


def record_cmd(
    scenario: Path = typer.Argument(..., help="Scenario TOML file (profile vllm-v1)."),
    out: str = typer.Option(..., "--out", "-o", help="Write the trace directory here: a new "
                            "path, or an earlier trace with --force."),
    engine: RealEngine = typer.Option(..., "--engine", help="The real engine to drive: vllm "
                                      "(0.33.0, in .venv-vllm: make vllm-env)."),
    force: bool = typer.Option(False, "--force", help="Replace --out when it holds an earlier "
                               "kvsim trace."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary and violations as "
                                 "one JSON object, the shape `kvsim check --json` prints."),
    max_violations: int = typer.Option(10, help="Violations to print."),
) -> None:
    """Run a scenario through a real engine's scheduler and write it as a kvsim trace, checked
    as it is written. Exit 0: no invariant fired; 1: one did; 2: bad input."""
    from sim.api import load_scenario
    from sim.engines.record import record
    from sim.engines.vllm import refuse_unsupported
    from sim.outputs import Kind, check_out

    with user_errors():
        check_out(out, Kind.TRACE, force)  # before any work: a refused --out costs nothing
        sc, base = load_scenario(scenario)
        refuse_unsupported(sc, str(scenario))
        with console.status(f"driving vLLM with {scenario.name}", spinner="dots") \
                if err_console.is_terminal and not as_json else _Quiet():
            res = record(sc, Path(out), base, str(scenario))
    if as_json:
        typer.echo(result_json("record", scenario, res.summary, res.violations))
    else:
        _print(res, max_violations)
    raise typer.Exit(1 if res.violations else 0)


class _Quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _print(res: Recorded, limit: int) -> None:
    s = res.summary
    t = Table(title="kvsim record · vllm 0.33.0", show_header=False, title_justify="left")
    for k, v in [("requests", f"{s['requests']} ({s['finished']} finished, "
                              f"{s['rejected']} rejected)"),
                 ("steps", f"{s['steps']}"),
                 ("tokens", f"{s['prompt_tokens']} prompt ({s['reused_tokens']} reused), "
                            f"{s['output_tokens']} output"),
                 ("acceptance", f"{s['acceptance_rate']:.3f} of drafts"),
                 ("peak KV", f"{s['peak_kv_blocks']} / {s['num_blocks']} blocks"),
                 ("preemptions", f"{s['preemptions']}"),
                 ("violations", f"{s['violations']}"),
                 ("trace", str(res.trace_dir))]:
        t.add_row(k, v)
    console.print(t)
    print_violations(console, res.violations, limit)
