"""`kvsim metrics TRACE_DIR`: latency percentiles, throughput, goodput, KV use of a trace."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer

from sim.errors import KvsimError


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def metrics(trace_dir: Annotated[Path, typer.Argument(help="trace directory")],
            slo_ttft_ms: Annotated[float | None, typer.Option(help="TTFT SLO for goodput")] = None,
            slo_tpot_ms: Annotated[float | None, typer.Option(help="TPOT SLO for goodput")] = None,
            as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
    """Print TTFT/TPOT/E2E percentiles (ms), throughput, goodput under SLOs and KV use."""
    from sim.cli.options import check_ms
    from sim.metrics import trace_metrics

    try:
        check_ms(slo_ttft_ms, "--slo-ttft-ms")
        check_ms(slo_tpot_ms, "--slo-tpot-ms")
        m = trace_metrics(trace_dir, slo_ttft_ms, slo_tpot_ms)
    except KvsimError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in m.items()}
        typer.echo(json.dumps(clean, indent=2))
        return
    width = max(map(len, m))
    for k, v in m.items():
        typer.echo(f"{k:<{width}}  {_fmt(v)}")


def register(app: typer.Typer) -> None:
    app.command("metrics")(metrics)
