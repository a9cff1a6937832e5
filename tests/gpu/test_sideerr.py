"""The prompts' step's token errors on the reference's stream, the replay's stream above it in
priority (`oracle.SIDE_ERRORS`, `gpu_backend.sideerr`): the same rows and errors, bit for bit, as
with the errors after a join; later steps that write truth its reference reads wait for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from replay_traces import SCENARIOS, big_verify

from gpu_backend import driver, oracle, sideerr
from gpu_backend.driver import replay
from gpu_backend.result import ReplayResult
from gpu_backend.tracedata import TraceData, load_trace

pytestmark = pytest.mark.gpu
pytest.importorskip("gpu_backend.refattn")  # Triton: the CUDA torch only
NAMES = sorted(SCENARIOS) + ["big_verify"]


def _trace(tmp: Path, name: str) -> TraceData:
    if name == "big_verify":
        return load_trace(big_verify(tmp / name, batch=16, kv=512, steps=6))
    return load_trace(SCENARIOS[name](tmp / name))


def _replay(trace: TraceData, monkeypatch: pytest.MonkeyPatch, late: bool) -> ReplayResult:
    from gpu_backend.replay import FlashInferKernels

    monkeypatch.setattr(oracle, "SIDE_ERRORS", late)
    return replay(trace, FlashInferKernels(trace.model.num_q_heads, "cuda"), "cuda")


def _rows(res: ReplayResult) -> list[tuple[Any, ...]]:
    return [(r.step, r.row, r.request, r.verdict, r.message) for r in res.rows]


def _errs(res: ReplayResult) -> np.ndarray:
    return np.array([r.err for r in res.rows], dtype=np.float64)


def test_the_replay_stream_is_above_the_reference_stream() -> None:
    loop = sideerr.loop_stream(torch.cuda.current_device())
    assert loop.priority < oracle._side_stream(torch.device("cuda")).priority


@pytest.mark.parametrize("name", NAMES)
def test_errors_on_the_side_give_the_joined_rows(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 name: str) -> None:
    trace = _trace(tmp_path, name)
    joined = _replay(trace, monkeypatch, False)
    calls: list[int] = []
    waits: list[bool] = []
    late, gate = sideerr.late_errors, driver._waits

    def spy_late(*a: Any, **kw: Any) -> Any:
        calls.append(torch.cuda.current_stream().priority)
        return late(*a, **kw)

    def spy_waits(*a: Any, **kw: Any) -> bool:
        waits.append(gate(*a, **kw))
        return waits[-1]

    monkeypatch.setattr(driver, "late_errors", spy_late)
    monkeypatch.setattr(driver, "_waits", spy_waits)
    side = _replay(trace, monkeypatch, True)
    assert _rows(side) == _rows(joined)
    np.testing.assert_array_equal(_errs(side), _errs(joined))  # NaN where NaN
    assert side.stats.get("graph_replays") == joined.stats.get("graph_replays")
    assert calls == [sideerr.loop_stream(torch.cuda.current_device()).priority]
    torch.cuda.synchronize()


def test_a_step_writing_what_the_reference_reads_waits(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The side's work never seen done (`Event.query`), so every step after the first is
    gated: the same rows and errors as joined; one that may write the truth the first step's
    reference reads waits (`Gate.hits`), one that does not goes on, and the scenarios have both."""
    hits: list[bool] = []
    gate = sideerr.Gate.hits

    def spy(self: sideerr.Gate, b: Any, fill: bool) -> bool:
        hits.append(gate(self, b, fill))
        return hits[-1]

    for name in sorted(SCENARIOS):
        trace = _trace(tmp_path, name)
        joined = _replay(trace, monkeypatch, False)
        with monkeypatch.context() as m:
            m.setattr(sideerr.Gate, "hits", spy)
            m.setattr(torch.cuda.Event, "query", lambda self: False)
            side = _replay(trace, m, True)
        assert _rows(side) == _rows(joined), name
        np.testing.assert_array_equal(_errs(side), _errs(joined))
    assert True in hits and False in hits
