"""gpu_backend.tools.fidelity without a GPU: step kinds, the prediction (the cost model's own
calibration interpolation, one layer), the error aggregation, and the command's plumbing with the
CPU reference kernels standing in for FlashInfer."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from replay_traces import Builder, prompt

from gpu_backend.tools import fidelity
from gpu_backend.tools.fidelity import StepTime, predict_us, predictor, step_kind, summarize
from sim.cost import load_calibration

ROOT = Path(__file__).resolve().parents[2]
CALIB = str(ROOT / "calibration" / "h200.json")
HEADS = (32, 8, 128)


def row(phase: str, q: int, kv: int) -> Any:
    return SimpleNamespace(phase=phase, q_len=q, kv_len=kv)


def test_step_kinds() -> None:
    assert step_kind([row("gen", 1, 10), row("gen", 1, 20)]) == "decode-only"
    assert step_kind([row("gen", 1, 10), row("gen", 4, 20)]) == "verify"
    assert step_kind([row("gen", 4, 10), row("ctx", 512, 512)]) == "with prefill rows"


def test_prediction_is_the_calibration_interpolation_for_one_layer() -> None:
    cost = predictor(CALIB, HEADS, 16)
    calib = load_calibration(CALIB, HEADS, 16)
    # a measured grid point comes back exactly (decode b=64 kv=2048 page 16: docs/gpu.md)
    key = ("decode", 64, 2048, 16)
    point = next(e for e in json.loads(Path(CALIB).read_text())["attention"]
                 if (e["kind"], e["batch"], e["kv_len"], e["page_size"]) == key)
    assert predict_us(cost, [row("gen", 1, 2048)] * 64) == pytest.approx(point["us"])
    # mixed step: gen rows one verify launch (max q, mean kv) + ctx rows one prefill launch
    rows = [row("gen", 4, 1000), row("gen", 3, 3000), row("ctx", 512, 700), row("ctx", 256, 256)]
    want = calib.attention_us("verify", 2, 4, 2000) + calib.attention_us("prefill", 2, 384, 478)
    assert predict_us(cost, rows) == pytest.approx(want)
    # between grid points it interpolates (monotone in kv_len here)
    a, b, c = (predict_us(cost, [row("gen", 1, kv)] * 64) for kv in (2048, 4000, 8192))
    assert a < b < c


def test_predictor_refuses_heads_the_table_lacks() -> None:
    with pytest.raises(Exception, match="num_q_heads"):
        predictor(CALIB, (8, 2, 128), 16)


def test_summarize_errors_and_totals() -> None:
    times = [StepTime(0, "verify", 4, 16, 100.0, 110.0), StepTime(1, "verify", 4, 16, 100.0, 80.0),
             StepTime(2, "verify", 4, 16, 200.0, 200.0),
             StepTime(3, "with prefill rows", 2, 600, 400.0, 200.0)]
    s = {r["kind"]: r for r in summarize(times)}
    assert set(s) == {"verify", "with prefill rows", "all"}  # no decode-only step: no row
    v = s["verify"]
    assert v["steps"] == 3
    assert v["median_err"] == pytest.approx(0.0)
    assert v["median_abs"] == pytest.approx(0.1)
    assert v["p90_abs"] == pytest.approx(np.percentile([0.1, 0.2, 0.0], 90))
    assert v["measured_ms"] == pytest.approx(0.4) and v["predicted_ms"] == pytest.approx(0.39)
    assert v["total_err"] == pytest.approx(-0.025)
    assert s["all"]["steps"] == 4 and s["all"]["total_err"] == pytest.approx(-210 / 800)
    md = fidelity.table(summarize(times))
    assert "| with prefill rows | 1 | -50.0% |" in md


def test_command_end_to_end_with_reference_kernels(tmp_path: Path, monkeypatch: Any) -> None:
    b = Builder(hq=32, hkv=8, d=128)
    b.request(0, prompt(0, 29))
    b.request(1, prompt(1, 45))
    b.step([b.ctx(0), b.ctx(1)])
    for a0, a1 in ((3, 0), (0, 2), (1, 3)):
        b.step([b.gen(0, 3, a0), b.gen(1, 3, a1)])
    trace = b.write(tmp_path, "mtp32")

    import gpu_backend.replay.flashinfer
    import gpu_backend.tools.fidelity
    from gpu_backend.replay.cpu import ReferenceKernels

    class Timed(ReferenceKernels):  # FlashInferKernels' attn_timing interface, on the CPU
        def __init__(self, hq: int, device: str, attn_timing: bool = False) -> None:
            super().__init__(hq, b.num_blocks)
            self.attn_events: list[tuple[int, list[Any]]] = []

        def run_step(self, pool: Any, sb: Any, *args: Any) -> Any:
            self.attn_events.append((sb.step, []))
            return super().run_step(pool, sb, *args)

        def attention_ms(self) -> dict[int, float]:
            return {k: 0.01 for k, _ in self.attn_events}

    monkeypatch.setattr(gpu_backend.replay.flashinfer, "FlashInferKernels", Timed)
    monkeypatch.setattr(gpu_backend.tools.fidelity, "meta",
                        lambda cmd: {"date": "D", "command": cmd})
    out = tmp_path / "f.md"
    assert fidelity.main([str(trace), "--calibration", CALIB, "--out", str(out),
                          "--max-steps", "3", "--warmup", "1", "--device", "cpu"]) == 0
    md = out.read_text()
    assert "| with prefill rows | 1 |" in md and "| verify | 2 |" in md and "| all | 3 |" in md
    assert "--max-steps 3" in md and "steps timed: 3" in md
