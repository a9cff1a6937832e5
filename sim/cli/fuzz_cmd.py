"""`kvsim fuzz --profile P`: a hypothesis campaign that shrinks the first violation to a file.
`kvsim fuzz --engine vllm`: workloads through vLLM's real scheduler and the vllm-v1 profile,
counted and shrunk per divergence and violation (sim/cli/fuzz_vllm.py).

Exit 0: the budget ended with no violation; 1: a violation was found, shrunk and written to
--out (with the command that reproduces it); 2: bad input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.live import Live
from rich.table import Table

from sim.cli.choices import Ignorable, RealEngine
from sim.cli.common import console, err_console, fail, user_errors


def register(app: typer.Typer) -> None:
    app.command("fuzz")(fuzz_cmd)


def fuzz_cmd(
    profile: str = typer.Option(None, "--profile", "-p",
                                help="Engine profile, e.g. trtllm-post-17264 or BASE+FAULT."),
    engine: RealEngine = typer.Option(None, "--engine", help="vllm: run each workload through "
                                      "vLLM 0.33.0's real scheduler (make vllm-env) and the "
                                      "vllm-v1 profile; count divergences and violations."),
    examples: int = typer.Option(100, "--examples", "-n",
                                 help="With --engine: workloads to run."),
    shrink: bool = typer.Option(True, "--shrink/--no-shrink",
                                help="With --engine: shrink each divergence and violation "
                                     "class to a scenario under --out."),
    budget: float = typer.Option(None, "--budget", help="Seconds to search before giving up "
                                 "(default 60; with --engine: no limit besides --examples)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the search's random streams."),
    out: str = typer.Option("fuzz-out", "--out", "-o",
                            help="Folder for the shrunk scenario.toml and finding.json "
                                 "(with --engine: report.json and one CLASS.toml per class); "
                                 "a new path, or an earlier finding with --force."),
    force: bool = typer.Option(False, "--force", help="Replace --out when it holds an earlier "
                               "kvsim fuzz finding."),
    workers: int = typer.Option(1, "--workers", "-j",
                                help="Processes sharing one example database (0 = all cores)."),
    db: Path = typer.Option(None, "--db",
                            help="Example database folder; rerun with it to resume "
                                 "(saved failures replay first). Default: .hypothesis/kvsim-fuzz."),
    ignore: list[Ignorable] = typer.Option([], "--ignore",  # noqa: B008
                                     help="Invariant (or 'hang'/'crash') not to count: a known "
                                          "bug the campaign should look past. Repeatable."),
    baseline: str = typer.Option(None, "--baseline",
                                 help="Count only violations this profile does not also show "
                                      "(e.g. fuzz BASE+FAULT with --baseline BASE)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Search generated scenarios for an invariant violation under PROFILE, or (--engine vllm)
    run workloads through the real vLLM and the vllm-v1 profile and count what differs."""
    from sim.fuzz.parallel import run_campaign

    if engine is not None:
        _vllm(profile, examples, shrink, budget, seed, out, force, workers, db,
              [i.value for i in ignore], baseline, as_json)
    if profile is None:
        fail("--profile: an engine profile is needed (or --engine vllm)")
    cfg = _validate(profile, 60.0 if budget is None else budget, seed, out, force, workers, db,
                    [i.value for i in ignore], baseline)
    with user_errors():
        if as_json or not err_console.is_terminal:
            finding, prog = run_campaign(cfg)
        else:
            with Live(_table(cfg.profile, None), console=err_console,
                      refresh_per_second=4) as live:
                finding, prog = run_campaign(cfg,
                                             lambda p: live.update(_table(cfg.profile, p)))
                live.update(_table(cfg.profile, prog))
    _finish(finding, prog, cfg, Path(out), as_json)


def _vllm(profile: str | None, examples: int, shrink: bool, budget: float | None, seed: int,
          out: str, force: bool, workers: int, db: Path | None, ignore: list[str],
          baseline: str | None, as_json: bool) -> None:
    from sim.cli.fuzz_vllm import check_vllm_options, run_vllm
    from sim.cli.options import check_seconds, check_seed
    from sim.fuzz.vllm_campaign import VllmCampaign
    from sim.outputs import Kind, check_out

    check_vllm_options(profile, workers, db, baseline, examples)
    with user_errors():
        check_out(out, Kind.FUZZ, force)  # before any work: a refused --out costs nothing
        if budget is not None:
            check_seconds(budget, "--budget")
        check_seed(seed)
    run_vllm(VllmCampaign(seed, examples, budget, shrink, ignore=frozenset(ignore)), Path(out),
             as_json)


def _validate(profile: str, budget: float, seed: int, out: str, force: bool, workers: int,
              db: Path | None, ignore: list[str], baseline: str | None
              ):  # type: ignore[no-untyped-def]
    from sim.check.registry import INVARIANTS
    from sim.cli.options import check_seconds, check_seed, check_workers
    from sim.fuzz.parallel import CampaignConfig
    from sim.outputs import Kind, check_out
    from sim.profiles import resolve_profile

    with user_errors():
        check_out(out, Kind.FUZZ, force)  # before any work: a refused --out costs nothing
        check_seconds(budget, "--budget")
        check_seed(seed)
        check_workers(workers)
        resolve_profile(profile)  # unknown profile/fault: exit 2 before any work
        if baseline is not None:
            resolve_profile(baseline)
    known = {*INVARIANTS, "POOL", "LIVENESS", "HOST", "hang", "crash"}
    for name in ignore:
        if name not in known:
            fail(f"--ignore {name!r} is not an invariant; known: {', '.join(sorted(known))}")
    # Not inside OUT: a finding replaces OUT whole, and the database must outlive it.
    db = db if db is not None else Path(".hypothesis/kvsim-fuzz")
    if db.exists() and not db.is_dir():
        fail(f"--db {db} exists and is not a folder")
    return CampaignConfig(profile, budget, seed, workers or os.cpu_count() or 1, db,
                          frozenset(ignore), baseline)


def _table(profile: str, p) -> Table:  # type: ignore[no-untyped-def]
    t = Table(title=f"kvsim fuzz · {profile}", show_header=False, title_justify="left")
    if p is None:
        t.add_row("status", "starting")
        return t
    rate = p.examples / p.elapsed if p.elapsed > 0 else 0.0
    t.add_row("examples", f"{p.examples} ({rate:.0f}/s, {len(p.per_worker)} workers)")
    t.add_row("distinct paths", str(len(p.paths)))
    t.add_row("best target", f"{p.best_target:.3f} peak KV utilisation")
    t.add_row("elapsed", f"{p.elapsed:.1f} s")
    return t


def _finish(finding, prog, cfg, out: Path, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    from sim.fuzz.finding import finding_record, repro_command, write_finding

    summary = {"profile": cfg.profile, "examples": prog.examples,
               "paths": len(prog.paths), "best_target": round(prog.best_target, 4)}
    if finding is None:
        if as_json:
            console.print_json(json.dumps({**summary, "finding": None}))
        else:
            console.print(f"clean: {prog.examples} examples, {len(prog.paths)} distinct paths, "
                          f"no invariant violated under {cfg.profile}")
        raise typer.Exit(0)
    with user_errors():
        path = write_finding(finding, out)
    if as_json:
        console.print_json(json.dumps({**summary, "finding": finding_record(finding),
                                       "scenario": str(path)}))
    else:
        console.print(f"[red]{finding.hit.invariant}[/]: {finding.hit.message}", highlight=False)
        console.print(f"shrunk scenario: {path}", highlight=False)
        console.print(f"reproduce: {repro_command(out, cfg.profile)}", highlight=False)
    raise typer.Exit(1)
