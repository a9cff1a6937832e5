"""The capacity scheduler delays a context that could reuse blocks another context is about to
write (TensorRT-LLM capacityScheduler.cpp `beneficialToSkip`), transcribed from
cpp/tests/unit_tests/batch_manager/capacitySchedulerTest.cpp (NVIDIA/TensorRT-LLM, commit
2ebe19fc63fb041fad33bc6bbdfcda045d5f3a7a): its scheduled sets per iteration and reuse counts."""

import pytest

from sim.api import parse_scenario, run


def rows_by_step(tmp_path, sc, profile="trtllm-post-17264"):  # type: ignore[no-untyped-def]
    from sim.trace.reader import read_trace
    res = run(sc, out=tmp_path / "t", profile=profile)
    steps: dict[int, list[tuple[int, str]]] = {}
    for r in read_trace(tmp_path / "t").tables["rows"].to_pylist():
        steps.setdefault(r["step"], []).append((r["request"], r["phase"]))
    return res, {k: sorted(v) for k, v in steps.items()}  # the scheduled set of each step


def duplicates(policy: str, n: int = 3):  # type: ignore[no-untyped-def]
    """DelayDuplicateRequest: blocks of 10 tokens, 3 identical 21-token prompts (one more than
    two blocks: the last prompt token is never reused), 2 new tokens each, 3 requests a step."""
    prompt = list(range(21))
    return parse_scenario({
        "seed": 0, "cache": {"tokens_per_block": 10, "num_blocks": 20, "reuse": "full"},
        "scheduler": {"policy": policy, "max_batch_size": 3, "max_num_tokens": 1000},
        "spec": {"mode": "none"}, "overlap": {"enabled": False},
        "workload": {"requests": [{"arrival_ns": 0, "prompt_tokens": prompt, "output_len": 2}
                                  for _ in range(n)]}})


@pytest.mark.parametrize("policy", ["max-utilization", "guaranteed-no-evict"])
def test_delay_duplicate_request(tmp_path, policy):
    res, steps = rows_by_step(tmp_path, duplicates(policy))
    assert steps == {0: [(0, "ctx")],  # 1 and 2 wait for the blocks 0 is writing
                     1: [(0, "gen"), (1, "ctx"), (2, "ctx")],
                     2: [(1, "gen"), (2, "gen")]}
    # getNumReusedBlocks() == promptLen / tokensPerBlock * 2
    assert res.summary["reused_tokens"] == 21 // 10 * 2 * 10
    assert res.violations == []


def test_without_the_reuse_tree_duplicates_are_not_delayed(tmp_path):
    _res, steps = rows_by_step(tmp_path, duplicates("guaranteed-no-evict"), "vllm-v1-legacy")
    assert steps[0] == [(0, "ctx"), (1, "ctx"), (2, "ctx")]
