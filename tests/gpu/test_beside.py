"""The fp32 reference on a stream of its own (`loop._reference_beside`, `TruthStore.side`) and
a step's context rows in one reference launch (`reference.together`,
`reference_triton.attend_rows`): off
the replay's stream, in eager steps and inside the graphs, and the replay's verdicts those of the
reference run in order, a context row a launch (its errors bit for bit with the rows alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from replay_traces import SCENARIOS, big_verify

from gpu_backend.device import reference
from gpu_backend.replay import loop
from gpu_backend.replay.loop import replay
from gpu_backend.trace import TraceData, load_trace
from gpu_backend.verdicts import ReplayResult

pytestmark = pytest.mark.gpu
# Triton comes with the CUDA torch only: where it is missing, nothing here can run.
refattn = pytest.importorskip("gpu_backend.device.reference_triton")
NAMES = ["clean_mtp", "overlap_uncorrected", "big_verify", "append_past_alloc",
         "shared_block_written"]


def _trace(tmp: Path, name: str) -> TraceData:
    if name == "big_verify":
        return load_trace(big_verify(tmp / name, batch=16, kv=512, steps=6))
    return load_trace(SCENARIOS[name](tmp / name))


def _replay(trace: TraceData, monkeypatch: pytest.MonkeyPatch, beside: bool,
            together: bool) -> ReplayResult:
    from gpu_backend.replay.flashinfer import FlashInferKernels

    with pytest.MonkeyPatch.context() as m:  # in order, a context row a launch: the oracles
        if not beside:
            m.setattr(loop, "_reference_beside", lambda *a: False)
        if not together:
            m.setattr(reference, "together", lambda *a: False)
        return replay(trace, FlashInferKernels(trace.model.num_q_heads, "cuda"), "cuda")


def _rows(res: ReplayResult) -> list[tuple[Any, ...]]:
    return [(r.step, r.row, r.request, r.verdict, r.message) for r in res.rows]


def _errs(res: ReplayResult) -> np.ndarray:
    return np.array([r.err for r in res.rows], dtype=np.float64)


@pytest.mark.parametrize("name", NAMES)
def test_the_reference_beside_the_kernels_gives_the_in_order_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    trace = _trace(tmp_path, name)
    in_order = _replay(trace, monkeypatch, False, False)
    streams: list[int] = []
    attend = refattn.attend

    def spy(*a: Any, **kw: Any) -> torch.Tensor:
        streams.append(torch.cuda.current_stream().cuda_stream)
        return attend(*a, **kw)

    monkeypatch.setattr(refattn, "attend", spy)
    side = _replay(trace, monkeypatch, True, False)
    assert _rows(side) == _rows(in_order)
    np.testing.assert_array_equal(_errs(side), _errs(in_order))  # NaN where NaN
    assert side.stats.get("graph_replays") == in_order.stats.get("graph_replays")
    main = torch.cuda.current_stream().cuda_stream
    assert streams and main not in streams


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("beside", [False, True])
def test_context_rows_in_one_launch_give_the_rows_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, beside: bool) -> None:
    trace = _trace(tmp_path, name)
    alone = _replay(trace, monkeypatch, False, False)
    launches: list[int] = []
    rows = refattn.attend_rows

    def spy(*a: Any, **kw: Any) -> torch.Tensor:
        launches.append(int(a[3].shape[1]))
        return rows(*a, **kw)

    monkeypatch.setattr(refattn, "attend_rows", spy)
    together = _replay(trace, monkeypatch, beside, True)
    assert _rows(together) == _rows(alone)
    # a row's tiles are its own launch's but for their height where it was under 64 queries
    np.testing.assert_allclose(_errs(together), _errs(alone), rtol=0, atol=1e-5)
    ctx = sum(1 for r in trace.rows[trace.steps[0].step] if r.phase == "ctx")
    if ctx > 1 or name == "big_verify":  # the prompts' step: its rows in one launch
        assert launches and launches[0] == ctx
