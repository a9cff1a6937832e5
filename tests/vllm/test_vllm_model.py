"""kvsim's model of vLLM (profile vllm-v1: sim/vllm_engine.py, sim/sched/vllm.py,
sim/kv/vllm_manager.py, sim/kv/vllm_pool.py) against values from vLLM's own tests.

These need no vLLM environment: the expected values are transcribed from vLLM's tests (named
on each) and from the real engine's runs of the same cases (test_vllm_engine.py pins them on
vLLM itself), never from the model's output.
"""

from __future__ import annotations

import pytest
from vllm_cases import CASES, _blocks_hit, _first_row

from sim.api import run
from sim.config import parse_scenario
from sim.errors import ProfileError, ScenarioError
from sim.kv.vllm_manager import VllmKV
from sim.sched.vllm import VRequest
from sim.vllm_engine import VllmRun


def _objs(name: str) -> list[dict]:
    return list(VllmRun(CASES[name]).run())


def test_prefill_block_ids_hits_and_free_order():
    """test_prefix_caching.py::test_prefill, through the scheduler: same-step hits, the free
    order (hashless blocks first, then LRU tail first)."""
    objs = _objs("prefill")
    assert {i: _blocks_hit(objs, i) for i in range(4)} == {
        0: ([1, 2, 3, 4], 0), 1: ([1, 2, 3, 5], 48), 2: ([1, 2, 3, 5], 48),
        3: ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1], 0)}


def test_evict_order_and_touch():
    """test_prefix_caching.py::test_evict."""
    objs = _objs("evict")
    assert _blocks_hit(objs, 0) == ([1, 2, 3, 4, 5, 6], 0)
    assert _blocks_hit(objs, 1) == ([7, 8, 9], 0)
    assert _blocks_hit(objs, 2) == ([1, 2, 6], 32)
    assert _first_row(objs, 2)[0]["free"] == 7


def test_computed_blocks_not_evicted():
    """test_prefix_caching.py::test_computed_blocks_not_evicted."""
    objs = _objs("not_evicted")
    assert [_blocks_hit(objs, i) for i in range(3)] == [([1], 0), ([2], 0), ([1, 2], 16)]


def test_schedule_partial_requests():
    """test_scheduler.py::test_schedule_partial_requests: the token budget splits request 1."""
    first = _objs("partial")[0]
    assert {r["request"]: r["q"] for r in first["rows"]} == {0: 800, 1: 224}


def test_reset_prefix_cache_through_the_engine():
    objs = _objs("reset")
    assert [_blocks_hit(objs, i)[1] for i in range(4)] == [0, 0, 48, 0]


def _req(rid: int, tokens: list[int], block_size: int = 16) -> VRequest:
    return VRequest(rid, list(tokens), len(tokens), 1, block_size, 0, True)


def test_reset_prefix_cache():
    """test_prefix_caching.py::test_reset_prefix_cache: refused while blocks are held; after
    the frees nothing is cached."""
    kv = VllmKV(11, 16, True, 8192)
    full = [i for i in range(3) for _ in range(16)]
    r0 = _req(0, full + [3] * 7)
    assert kv.allocate_slots(r0, 55) and kv.blocks[0] == [1, 2, 3, 4]
    r1 = _req(1, full + [4] * 7)
    hit, n = kv.computed_blocks(r1)
    assert len(r1.block_hashes) == 3 and len(hit) == 3 and n == 48
    assert kv.allocate_slots(r1, 7, hit) and kv.blocks[1][3:] == [5]
    assert not kv.pool.reset_prefix_cache() and kv.pool.cached
    kv.free(0)
    kv.free(1)
    assert kv.pool.reset_prefix_cache()
    assert not kv.pool.cached and all(h is None for h in kv.pool.hash)


def test_duplicate_cached_blocks_and_eviction():
    """test_prefix_caching.py::test_maybe_evict_cached_block: two blocks may hold one hash;
    evicting one keeps the hash cached on the other."""
    kv = VllmKV(5, 4, True, 64)
    a, b = _req(0, [1, 2, 3, 4, 9], 4), _req(1, [1, 2, 3, 4, 8], 4)
    kv.allocate_slots(a, 5)
    kv.allocate_slots(b, 5)  # scheduled together: no hit yet, both blocks get the hash
    h = a.block_hashes[0]
    assert kv.pool.cached == {h: {1: None, 3: None}}
    kv.free(0)
    kv.free(1)
    # queue: hashless 4, 2 (tails, freed last first), then hashed 1, 3 in the order freed
    assert list(kv.pool.free) == [4, 2, 1, 3]
    kv.pool.get_new_blocks(3)  # takes 4, 2 and evicts 1
    assert kv.pool.cached == {h: {3: None}} and kv.pool.first_cached(h) == 3


def test_free_queue_prepends_hashless_blocks_in_order():
    """kv_cache_utils FreeKVCacheBlockQueue.prepend_n (test_kv_cache_utils.py::
    test_free_kv_cache_block_queue_prepend_n): a second prepend goes ahead of the first,
    each keeping its order."""
    kv = VllmKV(7, 4, True, 64)
    kv.pool.get_new_blocks(6)
    kv.pool.free_blocks([6])
    kv.pool.free_blocks([4, 5])
    kv.pool.free_blocks([1, 2])
    assert list(kv.pool.free) == [1, 2, 4, 5, 6]


SMALL = {"profile": "vllm-v1", "limits": {"max_seq_len": 512}, "workload": {"requests": [
    {"arrival_ns": 0, "prompt_len": 40, "output_len": 4}]}}


def test_vllm_v1_runs_the_vllm_model_with_vllm_defaults():
    sc = parse_scenario(SMALL)
    assert (sc.cache.reuse, sc.overlap.enabled) == ("full", False)
    res = run(sc)
    assert res.summary["engine"] == "vllm-model" and res.violations == []
    assert res.summary["finished"] == 1


@pytest.mark.parametrize("kwargs, match", [
    ({"engine": "fast"}, "--engine fast: profile vllm-v1 runs kvsim's model of vLLM"),
    ({"profile": "vllm-v1+double_free"}, "fault 'double_free' is a switch of kvsim's"),
    ({"switches": {"backend": "xqa"}}, "switch 'backend' is a switch of kvsim's"),
])
def test_what_the_vllm_model_does_not_take_is_refused(kwargs, match):
    with pytest.raises((ScenarioError, ProfileError), match=match):
        run(parse_scenario(SMALL), **kwargs)


@pytest.mark.parametrize("section, key, value", [
    ("cache", "reset_prefix_cache_ns", [5]), ("spec", "eagle_block_drop", True)])
def test_vllm_behaviours_are_refused_under_trtllm_profiles(section, key, value):
    d = {**SMALL, "profile": "trtllm-post-17264", section: {key: value}}
    with pytest.raises(ProfileError, match=f"{section}.{key}: a vLLM behaviour"):
        run(parse_scenario(d))
