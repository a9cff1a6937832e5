"""`kvsim diff --engine vllm SCENARIO`: where kvsim's vllm-v1 profile departs from vLLM."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from sim.cli.choices import RealEngine
from sim.cli.common import console, err_console, user_errors

if TYPE_CHECKING:
    from sim.engines.diff import DiffResult

_SHOWN = 300  # characters of a field's value printed on the terminal (--json has it whole)


def register(app: typer.Typer) -> None:
    app.command("diff")(diff_cmd)


def diff_cmd(
    scenario: Path = typer.Argument(..., help="Scenario TOML file (profile vllm-v1)."),
    engine: RealEngine = typer.Option(..., "--engine", help="The real engine: vllm (0.33.0, "
                                      "in .venv-vllm: make vllm-env)."),
    every: bool = typer.Option(False, "--all", help="Tally every field that differs over the "
                               "whole run instead of stopping at the first step."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Run SCENARIO through the real engine and through the vllm-v1 profile; report the first
    step and field that differ. Exit 0: none differ; 1: one does; 2: bad input."""
    from sim.api import load_scenario
    from sim.engines.diff import diff
    from sim.engines.vllm import refuse_unsupported

    with user_errors():
        sc, base = load_scenario(scenario)
        refuse_unsupported(sc, str(scenario))
        with err_console.status("running both engines", spinner="dots") \
                if err_console.is_terminal and not as_json else _Quiet():
            res = diff(sc, base, every, str(scenario))
    if as_json:
        console.print_json(json.dumps(asdict(res), default=list))
    else:
        _print(res, every)
    raise typer.Exit(0 if res.first is None else 1)


class _Quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _short(v: object) -> str:
    s = repr(v)
    return escape(s if len(s) <= _SHOWN else s[:_SHOWN] + " …")


def _print(res: DiffResult, every: bool) -> None:
    ours, real = res.steps
    console.print(f"steps: kvsim vllm-v1 {ours}, vLLM 0.33.0 {real}")
    if res.first is None:
        console.print("[green]no divergence[/]")
        return
    d = res.first
    t = Table(title=f"first divergence: step {d.step}, {d.field}", show_header=False,
              title_justify="left")
    t.add_row("kvsim vllm-v1", _short(d.kvsim))
    t.add_row("vLLM 0.33.0", _short(d.vllm))
    console.print(t)
    if every:
        s = Table("field", "steps that differ", "first step", title="every divergence",
                  title_justify="left")
        for f, n in res.tally.items():
            s.add_row(f, str(n), str(res.first_by_field[f]))
        console.print(s)
