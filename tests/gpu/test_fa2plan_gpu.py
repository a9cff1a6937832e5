"""gpu_backend/host/graph_block.py against FlashInfer's own FA2 planner (CUDA-graph mode, the way
`graphs.StepGraphs` plans), and what a graph step does when the two differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from replay_traces import big_verify

from gpu_backend.host import graph_block
from gpu_backend.replay.loop import replay
from gpu_backend.trace import load_trace

pytestmark = pytest.mark.gpu


def _wrapper(rows: int, width: int, pages: int) -> Any:
    import flashinfer
    import torch

    buf = {name: torch.zeros(n, dtype=torch.int32, device="cuda") for name, n in
           (("qo", rows + 1), ("kv_indptr", rows + 1), ("kv_indices", pages),
            ("last", rows))}
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, qo_indptr_buf=buf["qo"],
        paged_kv_indptr_buf=buf["kv_indptr"], paged_kv_indices_buf=buf["kv_indices"],
        paged_kv_last_page_len_buf=buf["last"], backend="fa2"), buf


@pytest.mark.parametrize(("rows", "width"), [(64, 4), (128, 4), (16, 2), (200, 1), (3, 7)])
def test_every_plan_is_flashinfer_s(rows: int, width: int) -> None:
    """Random page counts, from empty rows to 8k tokens and ragged: the bytes FlashInfer's
    planner leaves in its pinned buffer for the device, and its plan info, are the port's."""
    import torch

    hq, hkv, d, page = 32, 8, 128, 16  # the replay benchmark's shape (Llama-3.1-8B)
    planner = graph_block.Planner(graph_block.Device.of("cuda"), hq, hkv, d, page, 2)
    lay = graph_block.layout(planner, rows, width)
    rng = np.random.default_rng(rows * 31 + width)
    w, buf = _wrapper(rows, width, rows * 600)
    qo = torch.arange(0, rows * width + 1, width, dtype=torch.int32)
    for case in range(60):
        top = [1, 8, 130, 513, 600][case % 5]
        pages = rng.integers(0, top + 1, rows)
        kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        last = torch.full((rows,), page, dtype=torch.int32)
        w.plan(qo, torch.from_numpy(kv_indptr), buf["kv_indices"], last, hq, hkv, d, page,
               causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
               seq_lens=torch.from_numpy(pages.astype(np.int32) * page), uniform_q_len=width)
        theirs = w._pin_memory_int_workspace_buffer.numpy()
        assert graph_block.agrees(lay, list(w._plan_info), theirs, kv_indptr), (case, pages)


def test_a_plan_the_port_gets_wrong_runs_eagerly(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step of every graph checks the port against FlashInfer's planner: a key
    whose plan differs is never replayed; its steps run eagerly, with the eager rows."""
    from gpu_backend.replay.flashinfer import FlashInferKernels

    trace = load_trace(big_verify(tmp_path / "t", batch=16, kv=512, steps=6))
    want = replay(trace, FlashInferKernels(32, "cuda", graphs=False), "cuda")
    monkeypatch.setattr(graph_block, "agrees", lambda *a: False)
    got = replay(trace, FlashInferKernels(32, "cuda", graphs=True), "cuda")
    assert [(r.step, r.row, r.verdict) for r in got.rows] == \
        [(r.step, r.row, r.verdict) for r in want.rows]
    assert (got.stats["plan_mismatches"], got.stats["graph_replays"],
            got.stats["graph_captures"]) == (1, 0, 0)
