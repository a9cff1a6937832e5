"""`kvsim calibrate --out PROFILE.json [--quick]`: measure FlashInfer/GEMM times on this GPU.

The output format (meta / attention / gemm) is described in docs/gpu.md; the cost model reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from sim.cli.common import user_errors
from sim.outputs import Kind, Plan, check_out, write_file


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate_cmd(
        out: str = typer.Option(..., "--out", help="profile JSON to write (a new path, or an "
                                "earlier calibration with --force)"),
        force: bool = typer.Option(False, "--force", help="Replace --out when it is an earlier "
                                   "kvsim calibration."),
        quick: bool = typer.Option(False, help="a handful of grid points (about a minute)"),
    ) -> None:
        """Time FlashInfer decode/verify/prefill and bf16 GEMMs on this GPU (needs CUDA)."""
        console = Console()
        with user_errors():  # before any work: a refused --out costs nothing
            plan = check_out(out, Kind.CALIBRATION, force)
        path = Path(out)
        try:
            import torch
        except ImportError:
            console.print("[red]error:[/red] torch is not installed")
            raise typer.Exit(2) from None
        if not torch.cuda.is_available():
            console.print("[red]error:[/red] no CUDA device: calibrate measures a GPU")
            raise typer.Exit(2)
        try:
            from gpu_backend.tools.fidelity import measure
        except ImportError as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        # a new file gets the partial table as it grows; an old one stays whole until the end
        keep = None if plan is Plan.REPLACE else (
            lambda p: write_file(path, json.dumps(p, indent=1), Kind.CALIBRATION))
        prof = measure(quick, log=lambda s: console.print(s, highlight=False), checkpoint=keep)
        write_file(path, json.dumps(prof, indent=1), Kind.CALIBRATION)
        console.print(f"wrote {path}: {len(prof['attention'])} attention and "
                      f"{len(prof['gemm'])} GEMM points")
