"""The loop's own preparation gets ahead while the host would wait for the device
(`loop.ReadySteps`): the same rows as a loop that only waits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from replay_traces import SCENARIOS, big_verify

from gpu_backend import verdicts
from gpu_backend.replay import loop
from gpu_backend.trace import TraceData, load_trace
from gpu_backend.verdicts import ReplayResult

pytestmark = pytest.mark.gpu


def _trace(tmp: Path, name: str) -> TraceData:
    if name == "big_verify":
        return load_trace(big_verify(tmp / name, batch=16, kv=512, steps=6))
    return load_trace(SCENARIOS[name](tmp / name))


def _replay(trace: TraceData) -> ReplayResult:
    from gpu_backend.replay.flashinfer import FlashInferKernels

    return loop.replay(trace, FlashInferKernels(trace.model.num_q_heads, "cuda"), "cuda")


@pytest.mark.parametrize("name", ["clean_mtp", "overlap_uncorrected", "append_past_alloc",
                                  "big_verify"])
def test_steps_prepared_ahead_give_the_rows_of_a_loop_that_waits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    trace = _trace(tmp_path, name)
    send = verdicts.send

    def slow_send(pending: list[Any], *rest: Any) -> Any:  # the device busy ~5 ms before each
        torch.cuda._sleep(10**7)  # read-back; `rest` is whatever else driver passes send
        return send(pending, *rest)

    monkeypatch.setattr(loop, "send", slow_send)
    monkeypatch.setattr(loop, "FLUSH", 1)  # the host waits after every step
    ahead = _replay(trace)
    monkeypatch.setattr(loop, "BANK", 0)
    waits = _replay(trace)
    assert ahead.stats["prepared_ahead"] > 0 and waits.stats["prepared_ahead"] == 0
    assert [(r.step, r.row, r.request, r.verdict, r.message) for r in ahead.rows] == \
        [(r.step, r.row, r.request, r.verdict, r.message) for r in waits.rows]
    assert ahead.watch == waits.watch
