"""`kvsim calibrate`: FlashInfer attention and bf16 GEMM times on this GPU, for the cost model.

Method: CUDA events around a block of launches after warm-up,
median over blocks, per-launch microseconds. Attention inputs: Llama-3.1-8B heads (32 q, 8 kv,
d 128), bf16, NHD, each request's pages contiguous and full except the last. GEMM: torch.matmul
bf16 [m, k] @ [k, n] for the model's projection shapes.

Cost-model fidelity: predicted vs measured attention time per step of a replayed trace.

python -m gpu_backend.tools.fidelity TRACE_DIR --calibration calibration/h200.json
    --out bench/results/cost_fidelity_h200.md [--max-steps N] [--warmup N]

Measured: the replay (`gpu_backend.replay.loop.replay`, FlashInfer) with `attn_timing`: CUDA events
around each attention launch of a step (append excluded), summed per step, after a warm-up pass
(JIT, plans). Predicted: `RooflineCost._attention_ns` with the calibration table (`sim/cost`: gen
rows one decode/verify launch at max q_len and mean kv_len, ctx rows one prefill launch) for one
layer, i.e. exactly what the cost model charges per layer. Error = (predicted − measured) /
measured, per step; grouped by step kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_backend.replay.loop import replay
from gpu_backend.trace import load_trace
from sim.cost import CostConfig, RooflineCost, load_calibration
from sim.cost.hardware import resolve_gpu, resolve_model
from sim.trace.records import RowRecord

HEADS = (32, 8, 128)  # Llama-3.1-8B: num_q_heads, num_kv_heads, head_dim
GEMM_NK = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
FULL: dict[str, Any] = {
        "batch": (1, 8, 32, 64, 128, 256), "kv": (512, 2048, 8192, 32768), "page": (16, 32, 64),
        "verify_q": (2, 3, 4), "prefill": ((1, 512), (1, 2048), (4, 512), (16, 128)),
        "gemm_m": (1, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384)}
QUICK: dict[str, Any] = {"batch": (1, 64), "kv": (2048,), "page": (16,), "verify_q": (4,),
         "prefill": ((1, 512),), "gemm_m": (64, 4096)}
MAX_KV_TOKENS = 1 << 21  # skip grid points whose cache would exceed 2M tokens (8 GiB at 8x128)


def _time_us(fn: Any, warmup: int = 3, blocks: int = 7, per_block: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(blocks):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_block):
            fn()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) * 1000.0 / per_block)
    return sorted(times)[len(times) // 2]


def _attention_point(fi: Any, ws: torch.Tensor, kind: str, batch: int, kv: int, q_len: int,
                     page: int) -> float:
    hq, hkv, d = HEADS
    nb = -(-kv // page)
    cache = torch.randn(batch * nb, 2, page, hkv, d, dtype=torch.bfloat16, device="cuda")
    indptr = torch.arange(batch + 1, dtype=torch.int32) * nb
    indices = torch.arange(batch * nb, dtype=torch.int32, device="cuda")
    lpl = torch.full((batch,), kv - (nb - 1) * page, dtype=torch.int32)
    q = torch.randn(batch * q_len, hq, d, dtype=torch.bfloat16, device="cuda")
    if kind == "decode":
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, lpl, hq, hkv, d, page, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16)
    else:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        qo = torch.arange(batch + 1, dtype=torch.int32) * q_len
        w.plan(qo, indptr, indices, lpl, hq, hkv, d, page, causal=True,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return _time_us(lambda: w.run(q, cache))


def _grid(g: dict[str, Any]) -> list[tuple[str, int, int, int, int]]:
    pts = [("decode", b, kv, 1, p)
           for b, kv, p in itertools.product(g["batch"], g["kv"], g["page"])]
    pts += [("verify", b, kv, q, p) for b, kv, q, p in
            itertools.product(g["batch"], g["kv"], g["verify_q"], g["page"])]
    pts += [("prefill", b, kv, q, p) for (b, q), kv, p in
            itertools.product(g["prefill"], g["kv"], g["page"]) if q <= kv]
    return [pt for pt in pts if pt[1] * pt[2] <= MAX_KV_TOKENS]


def measure(quick: bool, log: Any = print, checkpoint: Any = None) -> dict[str, Any]:
    """Run the grid (GEMMs first, they are quick); `checkpoint(profile)` gets the partial
    profile every 16 attention points, so a run cut short still leaves a usable table."""
    import flashinfer

    g = QUICK if quick else FULL
    cmd = "kvsim " + " ".join(sys.argv[1:])
    prof: dict[str, Any] = {"meta": meta(cmd), "attention": [], "gemm": []}
    for m, nk in itertools.product(g["gemm_m"], GEMM_NK):
        n, k = nk
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
        us = _time_us(lambda: x @ w)  # noqa: B023
        prof["gemm"].append({"m": m, "n": n, "k": k, "us": round(us, 2)})
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    hq, hkv, d = HEADS
    for kind, b, kv, q, p in _grid(g):
        us = _attention_point(flashinfer, ws, kind, b, kv, q, p)
        prof["attention"].append({"kind": kind, "batch": b, "kv_len": kv, "q_len": q,
                                  "page_size": p, "num_q_heads": hq, "num_kv_heads": hkv,
                                  "head_dim": d, "us": round(us, 2)})
        log(f"{kind} b={b} kv={kv} q={q} page={p}: {us:.1f} us")
        if checkpoint and len(prof["attention"]) % 16 == 0:
            checkpoint(prof)
    return prof


def meta(command: str) -> dict[str, Any]:
    import flashinfer

    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        drv = "unknown"
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "driver": drv, "torch": torch.__version__,
            "flashinfer": flashinfer.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "command": command}

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
    ap = argparse.ArgumentParser(prog="python -m gpu_backend.tools.fidelity", description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-steps", type=int, default=0, help="replay the first N steps (0: all)")
    ap.add_argument("--warmup", type=int, default=30, help="steps replayed untimed first")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    from gpu_backend.replay.flashinfer import FlashInferKernels
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
    cmd = "python -m gpu_backend.tools.fidelity " + " ".join(shlex.quote(x) for x in
                                                        (argv or sys.argv[1:]))
    notes = (f"\nReplay verdicts: {res.counts()}; steps timed: {len(times)} "
             f"(faulted steps excluded: {len(faulted)}).\n")
    calib_meta = cost.calib.meta if cost.calib else {}
    Path(a.out).write_text(report(times, meta(cmd), a.trace, a.calibration, calib_meta, notes))
    print(table(summarize(times)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
