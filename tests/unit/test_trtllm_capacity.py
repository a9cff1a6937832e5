"""TensorRT-LLM's own capacity-scheduler cases, transcribed and run against kvsim's profile.

Source: NVIDIA/TensorRT-LLM cpp/tests/unit_tests/batch_manager/capacitySchedulerTest.cpp
(commit 08c2acfa25d0fa1c9a06c008cdc6f03cf92a71c4). Each case's KV cache is
`getKvCacheManager(maxNumRequests, tokensPerBlock=10, maxNumTokens, maxNumTokensPerSeq=90)`:
a pool of maxNumTokens / 10 blocks and a 90-token window (kvsim: `limits.max_seq_len`). Its
`runTest` loop schedules, then appends one token per scheduled request (the last context chunk
yields the first token), so an iteration is a kvsim step with overlap and speculation off. The
expected values are the test's `ExpectedState{itBegin, itEnd, activeIds, scheduledState}` rows:
which requests are scheduled over which iterations, and each one's context position.
"""

from __future__ import annotations

import numpy as np
import pytest

from sim.api import parse_scenario, run
from sim.engine import Engine
from sim.profiles import resolve_profile
from sim.workload import iter_workload


def _scenario(pool_tokens: int, max_requests: int, P: int, max_new: int, chunk: int = 0):
    return parse_scenario({
        "cache": {"tokens_per_block": 10, "num_blocks": pool_tokens // 10, "reuse": "off"},
        "scheduler": {"policy": "guaranteed-no-evict", "max_batch_size": max_requests,
                      "max_num_tokens": 8192, "chunk_size": chunk},
        "spec": {"mode": "none"}, "overlap": {"enabled": False},
        "limits": {"max_seq_len": 90}, "model": {"max_position_embeddings": 90},
        "workload": {"requests": [{"arrival_ns": 0, "prompt_len": P,
                                   "output_len": max_new}] * 2}})


def _schedule_log(sc, profile: str) -> list[tuple[int, int, tuple[int, ...]]]:  # type: ignore
    """(itBegin, itEnd, scheduled request ids) ranges, as ExpectedState lists them."""
    steps: dict[int, list[int]] = {}

    def sink(st, rows, ev):  # type: ignore[no-untyped-def]
        steps[st.step] = sorted(r.request for r in rows)

    specs = iter_workload(sc.workload, np.random.default_rng(0), tokens_per_block=10)
    eng = Engine(sc, resolve_profile(profile), specs, sink)
    eng.run()
    assert eng.proc.violations == []
    out: list[tuple[int, int, tuple[int, ...]]] = []
    for k in sorted(steps):
        ids = tuple(steps[k])
        if out and out[-1][1] == k and out[-1][2] == ids:
            out[-1] = (out[-1][0], k + 1, ids)
        else:
            out.append((k, k + 1, ids))
    return out


PROFILES = ("trtllm-pre-17264", "trtllm-post-17264")


@pytest.mark.parametrize("profile", PROFILES)
def test_simple_should_fit(profile: str) -> None:
    """SimpleShouldFit (kGUARANTEED_NO_EVICT): 200 tokens, 2 requests P=10, max_new=80."""
    sc = _scenario(200, 2, 10, 80)
    assert _schedule_log(sc, profile) == [(0, 80, (0, 1))]


@pytest.mark.parametrize("profile", PROFILES)
def test_simple_doesnt_fit_guaranteed_completion(profile: str) -> None:
    """SimpleDoesntFitGuaranteedCompletion: 100 tokens hold one request's 9 blocks to
    completion, not two; the second waits until the first is done (160 iterations)."""
    sc = _scenario(100, 2, 10, 80)
    assert _schedule_log(sc, profile) == [(0, 80, (0,)), (80, 160, (1,))]


@pytest.mark.parametrize("profile", PROFILES)
def test_simple_doesnt_fit_guaranteed_completion_in_chunk(profile: str) -> None:
    """SimpleDoesntFitGuaranteedCompletionInChunk: P=30 in chunks of 20, max_new=60; context
    positions 0 and 20 at iterations 0 and 1 (61 and 64 for the second), 122 iterations."""
    sc = _scenario(100, 2, 30, 60, chunk=20)
    assert _schedule_log(sc, profile) == [(0, 61, (0,)), (61, 122, (1,))]
    rows: list = []
    specs = iter_workload(sc.workload, np.random.default_rng(0), tokens_per_block=10)
    Engine(sc, resolve_profile(profile), specs, lambda st, rs, ev: rows.extend(rs)).run()
    ctx = [(r.step, r.request, r.committed) for r in rows if r.phase == "ctx"]
    assert ctx == [(0, 0, 0), (1, 0, 20), (61, 1, 0), (62, 1, 20)]


def test_the_fast_engine_schedules_the_same() -> None:
    """The compiled engine covers this subset (no MTP, overlap or reuse): same step count."""
    for sc, steps in ((_scenario(100, 2, 10, 80), 160),
                      (_scenario(100, 2, 30, 60, chunk=20), 122)):
        for engine in ("reference", "fast"):
            assert run(sc, engine=engine).summary["steps"] == steps
