"""`kvsim calibrate --out PROFILE.json [--quick]`: measure FlashInfer/GEMM times on this GPU.

The output format (meta / attention / gemm) is described in docs/gpu.md; the cost model reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate_cmd(
        out: Path = typer.Option(..., "--out", help="profile JSON to write"),
        quick: bool = typer.Option(False, help="a handful of grid points (about a minute)"),
    ) -> None:
        """Time FlashInfer decode/verify/prefill and bf16 GEMMs on this GPU (needs CUDA)."""
        console = Console()
        try:
            import torch
        except ImportError:
            console.print("[red]error:[/red] torch is not installed")
            raise typer.Exit(2) from None
        if not torch.cuda.is_available():
            console.print("[red]error:[/red] no CUDA device: calibrate measures a GPU")
            raise typer.Exit(2)
        try:
            from gpu_backend.calibrate import measure
        except ImportError as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None
        prof = measure(quick, log=lambda s: console.print(s, highlight=False),
                       checkpoint=lambda p: out.write_text(json.dumps(p, indent=1)))
        out.write_text(json.dumps(prof, indent=1))
        console.print(f"wrote {out}: {len(prof['attention'])} attention and "
                      f"{len(prof['gemm'])} GEMM points")
