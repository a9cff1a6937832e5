"""A long step's reference and errors left on the side stream (`gpu_backend.sidework`): the
replay's verdicts are those of the replay that waits for them, with the replay's work on its own
stream of higher priority or on the caller's, and the steps after the long one run beside it
only while they cannot overwrite what it reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from replay_traces import SCENARIOS, big_verify, default_small

from gpu_backend import driver, sidework
from gpu_backend.result import ReplayResult
from gpu_backend.tracedata import TraceData, load_trace

pytestmark = pytest.mark.gpu
# Triton comes with the CUDA torch only: where it is missing, the reference runs in order
pytest.importorskip("gpu_backend.refattn")
NAMES = ["big_verify", "clean_mtp", "overlap_uncorrected", "append_past_alloc", "default_small"]


def _trace(tmp: Path, name: str) -> TraceData:
    if name == "big_verify":
        return load_trace(big_verify(tmp / name, batch=16, kv=512, steps=6))
    if name == "default_small":
        return load_trace(default_small(tmp / name))
    return load_trace(SCENARIOS[name](tmp / name))


def _replay(trace: TraceData, monkeypatch: pytest.MonkeyPatch, on: bool, priority: int
            ) -> ReplayResult:
    from gpu_backend.replay import FlashInferKernels

    monkeypatch.setattr(sidework, "ENABLED", on)
    monkeypatch.setattr(sidework, "PRIORITY", priority)
    # every step of a token or more is read back alone: the first step of each trace here
    # takes the side stream's way
    monkeypatch.setattr(driver, "SEND_TOKENS", 1)
    return driver.replay(trace, FlashInferKernels(trace.model.num_q_heads, "cuda"), "cuda")


def _rows(res: ReplayResult) -> list[tuple[Any, ...]]:
    return [(r.step, r.row, r.request, r.verdict, r.message) for r in res.rows]


def _errs(res: ReplayResult) -> np.ndarray:
    return np.array([r.err for r in res.rows], dtype=np.float64)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("priority", [-1, 0])
def test_errors_beside_the_next_steps_give_the_joined_replays_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, priority: int) -> None:
    trace = _trace(tmp_path, name)
    joined = _replay(trace, monkeypatch, False, 0)
    finished: list[int] = []
    finish = sidework.finish

    def spy(truth: Any, b: Any, out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        finished.append(b.step)
        return finish(truth, b, out, ref)

    monkeypatch.setattr(sidework, "finish", spy)
    beside = _replay(trace, monkeypatch, True, priority)
    assert _rows(beside) == _rows(joined)
    np.testing.assert_array_equal(_errs(beside), _errs(joined))  # NaN where NaN
    assert finished, "no step's errors went to the side stream"
    assert joined.stats["steps_beside_reference"] == 0
    if name == "big_verify":  # the same requests go on: their steps run beside it
        assert beside.stats["steps_beside_reference"] >= 1


def test_a_big_prompts_step_goes_beside_at_the_default_send(tmp_path: Path) -> None:
    # 32 prompts of ~2k: 65.6k query tokens, past SEND_TOKENS; the generation steps after it
    # may run beside its reference
    from gpu_backend.replay import FlashInferKernels

    trace = load_trace(big_verify(tmp_path / "b", batch=32, kv=2048, steps=4))
    assert sum(len(r.tokens) for r in trace.rows[trace.steps[0].step]) >= driver.SEND_TOKENS
    res = driver.replay(trace, FlashInferKernels(trace.model.num_q_heads, "cuda"), "cuda")
    assert {r.verdict for r in res.rows} == {"ok"}
    assert res.stats["steps_beside_reference"] >= 1
