"""The fp32 reference on a stream of its own (`oracle.BESIDE`, `TruthStore.side`): launched off
the replay's stream, in eager steps and inside the graphs, and the replay's rows and errors bit
for bit those of the reference run in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from replay_traces import SCENARIOS, big_verify

from gpu_backend import oracle, refattn
from gpu_backend.driver import replay
from gpu_backend.tracedata import TraceData, load_trace

pytestmark = pytest.mark.gpu


def _trace(tmp: Path, name: str) -> TraceData:
    if name == "big_verify":
        return load_trace(big_verify(tmp / name, batch=16, kv=512, steps=6))
    return load_trace(SCENARIOS[name](tmp / name))


def _fi(trace: TraceData) -> Any:
    from gpu_backend.replay import FlashInferKernels

    return FlashInferKernels(trace.model.num_q_heads, "cuda")


def _rows(res: Any) -> list[tuple[Any, ...]]:
    """Each row's verdict and error, bit for bit (NaN as a string: NaN != NaN)."""
    return [(r.step, r.row, r.request, r.verdict, r.message,
             r.err if r.err == r.err else "nan") for r in res.rows]


@pytest.mark.parametrize("name", ["clean_mtp", "overlap_uncorrected", "big_verify",
                                  "append_past_alloc", "shared_block_written"])
def test_the_reference_beside_the_kernels_gives_the_in_order_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    trace = _trace(tmp_path, name)
    monkeypatch.setattr(oracle, "BESIDE", False)
    in_order = replay(trace, _fi(trace), "cuda")
    monkeypatch.setattr(oracle, "BESIDE", True)
    streams: list[int] = []
    attend = refattn.attend

    def spy(*a: Any, **kw: Any) -> torch.Tensor:
        streams.append(torch.cuda.current_stream().cuda_stream)
        return attend(*a, **kw)

    monkeypatch.setattr(refattn, "attend", spy)
    side = replay(trace, _fi(trace), "cuda")
    assert _rows(side) == _rows(in_order)
    assert side.stats.get("graph_replays") == in_order.stats.get("graph_replays")
    main = torch.cuda.current_stream().cuda_stream
    assert streams and main not in streams
