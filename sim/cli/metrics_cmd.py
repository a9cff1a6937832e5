"""`kvsim metrics TRACE_DIR`: a trace's serving metrics, laid out as `vllm bench serve` prints its
result block; `--slo` adds goodput and whether each objective is met."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer

from sim.cli.common import user_errors
from sim.errors import KvsimError
from sim.slo import Target, parse_flag

WIDTH = 50
STATS = ("mean", "std", "p50", "p90", "p99")  # as sim.metrics.STATS (not imported: start-up)
TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2e": "End-to-end Latency",
          "queue": "Queueing Delay (arrival to first scheduled)"}
HEAD = (("requests", "Requests"), ("finished", "Successful requests"),
        ("rejected", "Rejected requests"), ("duration_s", "Simulated duration (s)"),
        ("input_tokens", "Total input tokens"), ("output_tokens", "Total generated tokens"),
        ("throughput_rps", "Request throughput (req/s)"),
        ("output_tps", "Output token throughput (tok/s)"),
        ("total_tps", "Total Token throughput (tok/s)"))
KV = ("kv_blocks_mean", "kv_blocks_peak", "kv_util_mean", "kv_util_peak", "draft_blocks_mean",
      "draft_blocks_peak", "draft_frac_of_used", "prefix_hit_rate", "acceptance_len",
      "acceptance_rate", "preemptions")
SLO_HELP = ("An objective METRIC:STAT=MS, e.g. ttft:p99=200ms or itl:mean=15ms; METRIC is ttft, "
            "tpot, itl or e2e, STAT is mean, p50, p90 or p99. Repeat for several. Adds goodput "
            "(finished requests per second whose own TTFT, TPOT and E2E meet their bounds) and "
            "whether each objective is met. Without it no SLO is claimed.")


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.2f}" if abs(v) >= 1 else f"{v:.4g}"
    return str(v)


def _line(label: str, v: object) -> str:
    return f"{label + ':':<40} {_fmt(v)}"


def _rule(title: str) -> str:
    return f" {title} ".center(WIDTH, "-")


def render(m: dict, slo: list[Target]) -> list[str]:
    """The text block: vLLM's result block (its labels), then SLOs, queueing and KV use."""
    out = [" Serving Result (simulated) ".center(WIDTH, "=")]
    out += [_line(label, m[k]) for k, label in HEAD]
    if slo:
        out.append(_rule("Service Level Objectives"))
        for t in slo:
            verdict = "met" if t.met(m) else "NOT met"
            out.append(_line(f"{t} ({verdict})", m[t.key]))
        out += [_line("Request goodput (req/s)", m["goodput_rps"]),
                _line("SLO attainment (share of requests)", m["slo_attainment"])]
    for name, title in TITLES.items():
        if f"{name}_mean_ms" not in m:
            continue
        out.append(_rule(title))
        unit = name.upper() if name != "queue" else "queueing"
        out += [_line(f"{s.capitalize()} {unit} (ms)", m[f"{name}_{s}_ms"])
                for s in STATS]
    out.append(_rule("KV cache and decoding"))
    out += [_line(k, m[k]) for k in KV if k in m]
    out.append("=" * WIDTH)
    return out


def _targets(items: list[str]) -> list[Target]:
    out = []
    for it in items:
        try:
            out.append(parse_flag(it))
        except ValueError as e:
            raise KvsimError(f"--slo: {e}") from None
    return out


def metrics(trace_dir: Annotated[Path, typer.Argument(help="Trace directory written by "
                                                           "`kvsim run --out`.")],
            slo: Annotated[list[str], typer.Option("--slo", metavar="METRIC:STAT=MS",
                                                   help=SLO_HELP)] = [],  # noqa: B006
            as_json: Annotated[bool, typer.Option("--json", help="Print the same fields as one "
                                                                 "JSON object.")] = False
            ) -> None:
    """Latency (mean, std, p50/p90/p99 of TTFT, TPOT, ITL, E2E, queueing), throughput and KV
    use of a trace; with --slo, goodput and whether each objective is met."""
    from sim.metrics import trace_metrics

    with user_errors():
        targets = _targets(slo)
        m = trace_metrics(trace_dir, targets)
    if as_json:
        clean: dict[str, object] = {k: (None if isinstance(v, float) and math.isnan(v) else v)
                                    for k, v in m.items()}
        if targets:
            clean["slo"] = {t.key: t.ms for t in targets}
        typer.echo(json.dumps(clean, indent=2))
        return
    for line in render(m, targets):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("metrics")(metrics)
