"""`kvsim fuzz --engine vllm`: the terminal side of sim/fuzz/vllm_campaign.py.

Exit 0: every workload ran alike in both engines and broke no invariant; 1: something
diverged, fired or crashed (each class shrunk to a scenario under --out); 2: bad input.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from sim.cli.common import console, err_console, fail, user_errors
from sim.fuzz.vllm_campaign import Tally, VllmCampaign

MAX_EXAMPLES = 1_000_000


def check_vllm_options(profile: str | None, workers: int, db: Path | None,
                       baseline: str | None, examples: int) -> None:
    """What a vLLM campaign cannot take: one line, exit 2, before any work."""
    if profile not in (None, "vllm-v1"):
        fail(f"--profile: --engine vllm compares against 'vllm-v1' only (got {profile!r})")
    if workers != 1:
        fail(f"--workers: --engine vllm runs one vLLM driver process: 1 (got {workers})")
    if db is not None:
        fail("--db: --engine vllm keeps no example database; rerun with the same --seed "
             f"(got {db})")
    if baseline is not None:
        fail(f"--baseline: --engine vllm compares against 'vllm-v1' itself (got {baseline!r})")
    if not 1 <= examples <= MAX_EXAMPLES:
        fail(f"--examples: 1 to {MAX_EXAMPLES} workloads (got {examples})")


def run_vllm(c: VllmCampaign, out: Path, as_json: bool) -> None:
    from sim.fuzz.vllm_report import counts, report, write_report

    with user_errors():
        if as_json:
            tally, shrunk = c.run()
        elif err_console.is_terminal:
            with Live(_table(None), console=err_console, refresh_per_second=2) as live:
                tally, shrunk = c.run(lambda t: live.update(_table(t)))
        else:  # a log, not a terminal: a line every so often
            tally, shrunk = c.run(_Lines(c.examples))
        failed = bool(c.findings(tally))
        rep = report(tally, shrunk, c.seed, c.examples, out if shrunk else None)
        if shrunk:
            write_report(rep, shrunk, out)
    if as_json:
        console.print_json(json.dumps(rep))
    else:
        _print(counts(tally), rep["shrunk"], failed)
    raise typer.Exit(1 if failed else 0)


class _Lines:
    def __init__(self, examples: int) -> None:
        self.examples, self.next, self.shrinking = examples, 0.0, ""

    def __call__(self, t: Tally) -> None:
        if t.shrinking != self.shrinking:
            self.shrinking = t.shrinking
            err_console.print(f"shrinking {t.shrinking}", highlight=False)
        elif t.elapsed >= self.next and not t.shrinking:
            self.next = t.elapsed + 30.0
            err_console.print(f"{t.workloads}/{self.examples} workloads, "
                              f"{t.workloads - t.clean} not clean, {t.elapsed:.0f} s",
                              highlight=False)


def _table(t: Tally | None) -> Table:
    tab = Table(title="kvsim fuzz · vllm 0.33.0 vs vllm-v1", show_header=False,
                title_justify="left")
    if t is None:
        tab.add_row("status", "starting vLLM")
        return tab
    rate = 60 * t.workloads / t.elapsed if t.elapsed > 0 else 0.0
    tab.add_row("workloads", f"{t.workloads} ({rate:.0f}/min), {t.clean} clean")
    tab.add_row("diverged", _counter(t.diverged))
    tab.add_row("violations", _counter(t.violations))
    tab.add_row("crashes", _counter(t.crashes))
    if t.shrinking:
        tab.add_row("shrinking", t.shrinking)
    return tab


def _counter(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "none"


def _print(c: dict, shrunk: list[dict], failed: bool) -> None:
    console.print(f"{c['workloads']} workloads through vLLM 0.33.0 and vllm-v1 in "
                  f"{c['elapsed_s']:.0f} s: {c['clean']} clean", highlight=False)
    for key in ("diverged", "differs", "violations", "crashes"):
        console.print(f"  {key}: {_counter(c[key])}", highlight=False)
    for f in shrunk:
        console.print(f"[red]{f['class']}[/] ({f['requests']} requests): "
                      f"{escape(f['message'])}", highlight=False)
        console.print(escape(f"  {f['scenario']}\n  reproduce: {f['reproduce']}"),
                      highlight=False)
    if not failed:
        console.print("[green]no divergence, no violation[/]")
