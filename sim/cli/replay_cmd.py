"""`kvsim replay TRACE_DIR`: replay a trace through FlashInfer (GPU) or the CPU reference.

Exit 0 when every row is ok, 1 when any is not, 2 on bad input (including "no CUDA device").
torch/flashinfer are imported inside the command: the simulator core never imports them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from sim.cli.choices import Backend, Watch
from sim.cli.common import err_console, fail, user_errors
from sim.cli.options import check_tolerance
from sim.errors import KvsimError
from sim.outputs import Kind, check_out

_FIRST_BAD = 10


def register(app: typer.Typer) -> None:
    @app.command("replay")
    def replay_cmd(
        trace_dir: Path = typer.Argument(..., help="trace directory written by `kvsim run`"),
        backend: Backend = typer.Option(Backend.flashinfer,
                                        help="flashinfer (GPU) or reference (CPU)"),
        isolate: bool = typer.Option(False, help="run in a child process; a CUDA fault is "
                                                 "pinned on its step and the replay carries on"),
        sanitize: bool = typer.Option(False, help="re-run under compute-sanitizer memcheck "
                                                  "with the caching allocator off"),
        json_out: str | None = typer.Option(None, "--json", help="write every row's verdict "
                                            "(a new path, or an earlier one with --force)"),
        force: bool = typer.Option(False, "--force", help="Replace --json when it is an "
                                   "earlier kvsim replay's."),
        tol: float | None = typer.Option(None, help="max |out - ref| of an ok row (default "
                                                    "2e-2, see docs/gpu.md)"),
        watch: Watch = typer.Option(
            Watch.incremental, help="how writes to pages no append aimed at are found: "
            "incremental (the pages each step's appends target, the whole pool every 16 steps; "
            "if a page changed elsewhere, the trace is replayed again with full) or full (the "
            "whole pool every step). The same verdicts; incremental reads a third fewer bytes "
            "per step. --isolate uses incremental"),
        eager: bool = typer.Option(False, help="launch every step's kernels one by one; by "
                                   "default a steady MTP step (one FA2 launch over rows of one "
                                   "width) replays as a CUDA graph: the same kernels and "
                                   "verdicts in less wall time (docs/gpu.md)"),
    ) -> None:
        """Replay TRACE_DIR and give each (step, row) a verdict: ok/nan/mismatch/corrupt/fault."""
        console = Console()
        if json_out is not None:  # before any work: a refused --json costs nothing
            with user_errors():
                check_out(json_out, Kind.REPLAY, force, "--json")
        if sanitize:
            _reexec_sanitized()
        try:
            check_tolerance(tol)
            res = _run(trace_dir, backend.value, isolate, tol, watch.value, not eager)
        except KvsimError as e:
            fail(str(e))  # one line, whatever the terminal's width
        _summary(console, res)
        if json_out is not None:
            from gpu_backend.replay.run import write_json

            write_json(res, Path(json_out))
        raise typer.Exit(0 if res.ok else 1)


def _run(trace_dir: Path, backend: str, isolate: bool, tol: float | None, watch: str,
         graphs: bool = True) -> Any:
    from gpu_backend.verdicts import DEFAULT_TOL

    tol = DEFAULT_TOL if tol is None else tol
    if isolate:
        from gpu_backend.replay.run import replay_isolated

        return replay_isolated(trace_dir, backend, tol)
    from gpu_backend.replay.run import run_replay

    current = {"step": -1}
    with _progress(trace_dir) as (bar, task):
        def on_step(step: int, what: str) -> None:
            current["step"] = step
            if what == "done":
                bar.update(task, completed=step + 1)

        try:
            return run_replay(trace_dir, backend, tol, on_step=on_step, watch=watch,
                              graphs=graphs)
        except RuntimeError as e:
            _fault(e, current["step"], backend)


@contextmanager
def _progress(trace_dir: Path) -> Iterator[tuple[Progress, TaskID]]:
    """A progress bar on stderr over the trace's steps (the CPU replay of `make run`'s trace
    takes minutes); none when stderr is not a terminal."""
    try:
        total = int(json.loads((trace_dir / "manifest.json").read_text())["counts"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        total = None  # run_replay says what is wrong with the trace
    with Progress(TextColumn("replaying {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("steps"), TimeElapsedColumn(), console=err_console, transient=True,
                  disable=not err_console.is_terminal) as bar:
        yield bar, bar.add_task(trace_dir.name, total=total)


def _fault(e: RuntimeError, step: int, backend: str) -> NoReturn:
    """torch's out-of-memory or a device fault as a plain error naming the step."""
    where = f"during step {step} ({str(e)[:200]})"
    if "out of memory" in str(e) or "allocate memory" in str(e):  # torch's, GPU or CPU
        raise KvsimError(f"out of memory {where}: the step's arrays do not fit "
                         f"({backend} backend)") from None
    # a CUDA fault: the context is gone, say where and how to go on
    raise KvsimError(f"device fault {where}; rerun with --isolate to attribute it and "
                     "carry on") from None


def _reexec_sanitized() -> None:
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        Console().print("[red]error:[/red] compute-sanitizer is not on PATH")
        raise typer.Exit(2)
    args = [a for a in sys.argv[1:] if a != "--sanitize"]
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    cmd = [exe, "--tool", "memcheck", "--print-limit", "20", sys.executable, "-c",
           "from sim.cli import main; main()", *args]
    os.execvpe(exe, cmd, env)


def _summary(console: Console, res: Any) -> None:
    from gpu_backend.verdicts import max_ok_error

    t = Table(title=f"{res.backend} replay of {Path(res.trace).name} (tol {res.tol:g})")
    t.add_column("verdict")
    t.add_column("rows", justify="right")
    for verdict, n in res.counts().items():
        t.add_row(verdict, str(n))
    console.print(t)
    console.print(f"max |out - ref| over ok rows: {max_ok_error(res):.3g}"
                  + (f"; pages watched: {res.watch}" if res.watch else ""))
    if res.stats.get("plan_mismatches"):
        console.print(f"[yellow]note:[/yellow] {res.stats['plan_mismatches']} CUDA-graph shape(s) "
                      "ran eagerly: kvsim's port of FlashInfer's FA2 planner "
                      "(gpu_backend/host/graph_block.py, from 0.7.2.post1) disagreed with this "
                      "FlashInfer's plan. The verdicts are unaffected; the replay is slower. "
                      "Please report it with your FlashInfer version.")
    bad = [r for r in res.rows if r.verdict != "ok"][:_FIRST_BAD]
    if not bad:
        return
    b = Table(title="first rows that are not ok")
    for col in ("step", "row", "request", "phase", "q_len", "verdict", "max err", "message"):
        b.add_column(col)
    for r in bad:
        b.add_row(str(r.step), str(r.row), str(r.request), r.phase, str(r.q_len), r.verdict,
                  f"{r.err:.3g}", r.message[:80])
    console.print(b)
