"""Cost-model fidelity: predicted vs measured attention time per step of a replayed trace.

python -m gpu_backend.fidelity TRACE_DIR --calibration calibration/h200.json
    --out bench/results/cost_fidelity_h200.md [--max-steps N] [--warmup N]

Measured: the replay (`gpu_backend.driver.replay`, FlashInfer) with `attn_timing`: CUDA events
around each attention launch of a step (append excluded), summed per step, after a warm-up pass
(JIT, plans). Predicted: `RooflineCost._attention_ns` with the calibration table (`sim/cost`: gen
rows one decode/verify launch at max q_len and mean kv_len, ctx rows one prefill launch) for one
layer, i.e. exactly what the cost model charges per layer. Error = (predicted − measured) /
measured, per step; grouped by step kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.cost import CostConfig, RooflineCost, load_calibration
from sim.cost.hardware import resolve_gpu, resolve_model
from sim.trace.records import RowRecord

KINDS = ("decode-only", "verify", "with prefill rows")


@dataclass(frozen=True)
class StepTime:
    step: int
    kind: str
    rows: int
    tokens: int
    measured_us: float
    predicted_us: float

    @property
    def err(self) -> float:
        return (self.predicted_us - self.measured_us) / self.measured_us


def step_kind(rows: Sequence[RowRecord]) -> str:
    if any(r.phase == "ctx" for r in rows):
        return "with prefill rows"
    return "verify" if any(r.q_len > 1 for r in rows) else "decode-only"


def predictor(calibration: str, heads: tuple[int, int, int], page_size: int) -> RooflineCost:
    """The cost model's attention for one layer of a model with `heads` (q, kv, dim), from the
    calibration entries measured at the trace's page size."""
    calib = load_calibration(calibration, heads, page_size)
    if not calib.attn:
        raise SystemExit(f"{calibration}: no attention entry for heads {heads}, page {page_size}")
    model = resolve_model("llama-3.1-8b").model_copy(update=dict(
        num_layers=1, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2]))
    return RooflineCost(CostConfig(kind="roofline"), model, resolve_gpu("h200"), calib)


def predict_us(cost: RooflineCost, rows: Sequence[RowRecord]) -> float:
    q = np.array([r.q_len for r in rows], dtype=np.int64)
    kv = np.array([r.kv_len for r in rows], dtype=np.int64)
    ctx = np.array([r.phase == "ctx" for r in rows], dtype=bool)
    return cost._attention_ns(q, kv, ctx) / 1e3 / cost.m.num_layers


def summarize(times: Sequence[StepTime]) -> list[dict[str, Any]]:
    """One row per step kind present, then 'all': steps, median / p90 of the signed and absolute
    per-step error, and the totals' error."""
    out = []
    for kind in (*KINDS, "all"):
        ts = [t for t in times if kind in ("all", t.kind)]
        if not ts:
            continue
        e = np.array([t.err for t in ts])
        meas = sum(t.measured_us for t in ts)
        pred = sum(t.predicted_us for t in ts)
        out.append({"kind": kind, "steps": len(ts), "median_err": float(np.median(e)),
                    "median_abs": float(np.median(np.abs(e))),
                    "p90_abs": float(np.percentile(np.abs(e), 90)),
                    "measured_ms": meas / 1e3, "predicted_ms": pred / 1e3,
                    "total_err": (pred - meas) / meas})
    return out


def table(summary: Sequence[dict[str, Any]]) -> str:
    lines = ["| step kind | steps | median err | median \\|err\\| | p90 \\|err\\| | measured ms "
             "| predicted ms | total err |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['kind']} | {s['steps']} | {s['median_err']:+.1%} | "
                     f"{s['median_abs']:.1%} | {s['p90_abs']:.1%} | {s['measured_ms']:.2f} | "
                     f"{s['predicted_ms']:.2f} | {s['total_err']:+.1%} |")
    return "\n".join(lines)


def report(times: Sequence[StepTime], meta: dict[str, Any], trace: str, calibration: str,
           calib_meta: dict[str, Any], notes: str = "") -> str:
    worst = sorted(times, key=lambda t: -abs(t.err))[:5]
    w = "\n".join(f"| {t.step} | {t.kind} | {t.rows} | {t.tokens} | {t.measured_us:.1f} | "
                  f"{t.predicted_us:.1f} | {t.err:+.1%} |" for t in worst)
    return f"""# Cost-model fidelity: predicted vs measured attention per step

- date: {meta.get('date')}; GPU: {meta.get('gpu')}; driver {meta.get('driver')}; torch \
{meta.get('torch')} (CUDA {meta.get('cuda')}); FlashInfer {meta.get('flashinfer')}
- command: `{meta.get('command')}`
- trace: `{trace}`; calibration: `{calibration}` (measured {calib_meta.get('date')} on \
{calib_meta.get('gpu')})
- measured: CUDA events around each attention launch of the step (append excluded; a GPU spin
  before each launch hides host launch overhead), summed per step, one layer, after a warm-up
  pass; predicted: `sim.cost.RooflineCost._attention_ns` with this calibration, for one layer.
  err = (predicted − measured) / measured per step.

{table(summarize(times))}

Worst steps:

| step | kind | rows | tokens | measured µs | predicted µs | err |
|---|---|---|---|---|---|---|
{w}
{notes}"""


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_backend.fidelity", description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-steps", type=int, default=0, help="replay the first N steps (0: all)")
    ap.add_argument("--warmup", type=int, default=30, help="steps replayed untimed first")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    from gpu_backend.calibrate import meta
    from gpu_backend.driver import replay
    from gpu_backend.replay import FlashInferKernels
    from gpu_backend.tracedata import load_trace

    trace = load_trace(a.trace)
    m = trace.model
    cost = predictor(a.calibration, (m.num_q_heads, m.num_kv_heads, m.head_dim), m.page_size)
    if a.max_steps:
        trace = dataclasses.replace(trace, steps=trace.steps[:a.max_steps])
    kern = FlashInferKernels(m.num_q_heads, a.device, attn_timing=True)
    replay(dataclasses.replace(trace, steps=trace.steps[:a.warmup]), kern, a.device)
    kern.attn_events.clear()
    res = replay(trace, kern, a.device)
    measured = kern.attention_ms()
    faulted = {r.step for r in res.rows if r.verdict == "fault"}
    times = [StepTime(s.step, step_kind(trace.rows[s.step]), len(trace.rows[s.step]),
                      sum(r.q_len for r in trace.rows[s.step]), measured[s.step] * 1e3,
                      predict_us(cost, trace.rows[s.step]))
             for s in trace.steps if s.step in measured and s.step not in faulted]
    cmd = "python -m gpu_backend.fidelity " + " ".join(shlex.quote(x) for x in
                                                        (argv or sys.argv[1:]))
    notes = (f"\nReplay verdicts: {res.counts()}; steps timed: {len(times)} "
             f"(faulted steps excluded: {len(faulted)}).\n")
    calib_meta = cost.calib.meta if cost.calib else {}
    Path(a.out).write_text(report(times, meta(cmd), a.trace, a.calibration, calib_meta, notes))
    print(table(summarize(times)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
