"""Preparation workers (gpu_backend/workers.py) on the GPU: a FlashInfer replay with its steps
prepared by forked workers (the default on a GPU host for a long trace) gives the rows of the
loop's own preparation, CUDA graphs included; the workers never touch the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from replay_traces import SCENARIOS, big_verify

from gpu_backend import prepare
from gpu_backend.driver import replay
from gpu_backend.tracedata import TraceData, load_trace

pytestmark = pytest.mark.gpu


def _replay(trace: TraceData, workers: int) -> list[tuple[int, int, str, float]]:
    from gpu_backend.replay import FlashInferKernels

    res = replay(trace, FlashInferKernels(trace.model.num_q_heads, "cuda"), "cuda",
                 workers=workers)
    assert res.stats["prepare_workers"] == workers
    return [(r.step, r.row, r.verdict, r.err) for r in res.rows]


@pytest.mark.parametrize("name", ["big_verify", "append_past_alloc", "overlap_uncorrected"])
def test_workers_give_the_loops_rows(tmp_path: Path, name: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = big_verify(tmp_path / name, batch=16, kv=512, steps=24) if name == "big_verify" \
        else SCENARIOS[name](tmp_path / name)
    t = load_trace(path)
    want = _replay(t, 0)
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 2)  # several chunks, every worker some
    got = _replay(t, 3)
    assert [g[:3] for g in got] == [w[:3] for w in want]
    # a worker grows its own graph capacities: another padding, the same kernels
    np.testing.assert_allclose([g[3] for g in got], [w[3] for w in want], atol=2e-3)
