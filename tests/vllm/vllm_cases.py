"""Cases taken from vLLM's own tests (tests/v1/core/test_prefix_caching.py, test_scheduler.py),
as payloads for the vLLM driver (sim/engines/vllm_driver.py) and for kvsim's model of vLLM
(sim/vllm_engine.py), which take the same payload. The block ids, hit lengths and free counts
the tests pin are vLLM's."""

from __future__ import annotations

LATER = 10**6  # ns: long after the requests before it finished (a step here is ~1 µs)


def _req(i: int, prompt: list[int], arrival: int = 0) -> dict:
    # max_tokens 1: each request finishes (and is freed) right after its prefill, as the
    # tests free theirs right after allocating
    return {"id": i, "arrival_ns": arrival, "prompt": prompt, "output": [7, 7, 7],
            "output_len": 1, "accept": []}


def _held(i: int, arrival: int) -> dict:
    """A request that runs (and holds its blocks) for many steps after it arrives."""
    return {"id": i, "arrival_ns": arrival, "prompt": [9] * 16, "output": [7] * 104,
            "output_len": 100, "accept": []}


def _case(block_size: int, num_blocks: int, reqs: list[dict], budget: int = 256,
          max_len: int = 8192) -> dict:
    return {"block_size": block_size, "num_blocks": num_blocks, "prefix_caching": True,
            "max_num_seqs": 16, "max_num_batched_tokens": budget,
            "long_prefill_token_threshold": 0, "max_model_len": max_len,
            "max_position_embeddings": max_len, "num_spec_tokens": 0,
            "dev_ns": [1000, 0, 0], "host_ns": [0, 0], "max_steps": 64, "requests": reqs,
            # vLLM's tests build the manager without EngineCore's start-up check (a pool that
            # holds one request of max_model_len), and so do these
            "startup_check": False}


COMMON = [i for i in range(3) for _ in range(16)]  # three full blocks of 16
CASES = {
    # test_prefix_caching.py::test_prefill
    "prefill": _case(16, 11, [_req(0, COMMON + [3] * 7), _req(1, COMMON + [3] * 5),
                              _req(2, COMMON + [3] * 6, LATER), _req(3, [99] * 160, 2 * LATER)]),
    # test_prefix_caching.py::test_evict
    "evict": _case(16, 11, [_req(0, list(range(87))), _req(1, list(range(87, 135))),
                            _req(2, list(range(35)), LATER)]),
    # test_prefix_caching.py::test_computed_blocks_not_evicted
    "not_evicted": _case(16, 3, [_req(0, list(range(16))), _req(1, list(range(16, 32))),
                                 _req(2, list(range(32)), LATER)]),
    # test_scheduler.py::test_schedule_partial_requests (its text-only form: create_requests
    # gives request i the prompt [i] * num_tokens)
    "partial": _case(16, 200, [_req(i, [i] * 800) for i in range(3)], budget=1024,
                     max_len=1024),
    # test_prefix_caching.py::test_reset_prefix_cache, through the engine: a reset while
    # request 1 holds blocks does nothing (request 2 still hits request 0's blocks), one after
    # every free empties the cache (request 3 hits nothing)
    "reset": dict(_case(16, 11, [_req(0, COMMON + [3] * 7), _held(1, LATER - 5000),
                                 _req(2, COMMON + [4] * 7, LATER + 1),
                                 _req(3, COMMON + [5] * 7, 3 * LATER)]),
                  reset_prefix_cache_ns=[LATER, 2 * LATER], max_steps=400),
}


def _first_row(objs: list[dict], request: int) -> tuple[dict, dict]:
    """(step object, row) of the request's first scheduled step."""
    for o in objs:
        for r in o.get("rows", ()):
            if r["request"] == request:
                return o, r
    raise AssertionError(f"request {request} never scheduled")


def _blocks_hit(objs: list[dict], request: int) -> tuple[list[int], int]:
    row = _first_row(objs, request)[1]
    return row["blocks"], row["hit"]
