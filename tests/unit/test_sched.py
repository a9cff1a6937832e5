"""Scheduler policy pinned exactly: FCFS, budgets, chunked prefill, both capacity policies."""

import numpy as np

from sim.api import parse_scenario
from sim.kv import EventLog, KVManager
from sim.profiles import resolve_profile
from sim.request import Request, State
from sim.sched.scheduler import Scheduler


def make(policy="guaranteed-no-evict", blocks=16, B=4, D=0, chunk=0, tokens=64, batch=4,
         overlap=False):  # type: ignore[no-untyped-def]
    sc = parse_scenario({
        "cache": {"tokens_per_block": B, "num_blocks": blocks, "reuse": "off"},
        "scheduler": {"policy": policy, "chunk_size": chunk, "max_num_tokens": tokens,
                      "max_batch_size": batch},
        "spec": {"mode": "mtp", "max_draft_len": D} if D else {"mode": "none"},
        "overlap": {"enabled": overlap}, "limits": {"max_seq_len": 256},
        "model": {"max_position_embeddings": 256},
        "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 1, "output_len": 1}]}})
    kv = KVManager(blocks, B, "off", EventLog())
    return Scheduler(sc, resolve_profile("trtllm-post-17264"), kv, overlap)


def req(rid, P, out=4):  # type: ignore[no-untyped-def]
    return Request(rid, 0, P, out, np.arange(P + out + 8, dtype=np.int32), prefill_len=P,
                   n_host=P)


def test_fcfs_admission_stops_at_the_first_request_that_does_not_fit():
    s = make(blocks=6)  # GNE: blocks to completion = ceil((P + out) / 4)
    for r in (req(0, 8), req(1, 12), req(2, 2)):  # needs 3, 4, 2 blocks
        s.waiting.append(r)
    b = s.schedule(0)
    assert [(r.rid, start, n) for r, start, n in b.ctx] == [(0, 0, 8)]
    assert [r.rid for r in s.waiting] == [1, 2]  # request 2 would fit but FCFS waits


def test_token_budget_and_chunked_prefill():
    s = make(chunk=6, tokens=10, blocks=32)
    s.waiting.extend([req(0, 14), req(1, 5)])
    b = s.schedule(0)
    assert [(r.rid, start, n) for r, start, n in b.ctx] == [(0, 0, 6), (1, 0, 4)]
    b = s.schedule(1)  # chunks continue where they stopped; budget 10 again
    assert [(r.rid, start, n) for r, start, n in b.ctx] == [(0, 6, 6), (1, 4, 1)]


def test_without_chunking_a_prompt_over_the_budget_waits():
    s = make(tokens=8, blocks=32)
    s.waiting.extend([req(0, 6), req(1, 6)])
    b = s.schedule(0)
    assert [r.rid for r, _s, _n in b.ctx] == [0] and [r.rid for r in s.waiting] == [1]


def test_generation_rows_first_and_reserve_one_plus_d():
    s = make(D=3, blocks=32, tokens=20)
    r0 = req(0, 8)
    s.waiting.append(r0)
    s.schedule(0)
    r0.state, r0.n_host = State.GENERATION, 9  # context processed: N = P + 1
    s.waiting.append(req(1, 8))
    b = s.schedule(1)
    assert [(r.rid, d) for r, d in b.gen] == [(0, 3)]
    assert [r.rid for r, _s, _n in b.ctx] == [1]
    assert s.kv.reserved[0] == 8 + 4  # C += 1 + D


def test_gne_admission_counts_no_spec_or_overlap_headroom():
    """TRT-LLM getRemainingBlocksToCompletion: ceil((P + max_new) / B), whatever D and overlap
    (capacitySchedulerTest's expectations likewise count prompt + max_new only)."""
    s = make(D=3, blocks=3, B=4, overlap=True)  # P 8 + out 4 = 12 slots = 3 blocks
    s.waiting.append(req(0, 8))
    assert len(s.schedule(0)) == 1 and not s.violations
    s2 = make(D=3, blocks=2, B=4, overlap=True)
    s2.waiting.append(req(0, 8))
    assert len(s2.schedule(0)) == 0


def test_max_utilization_preempts_the_newest_request_when_a_reservation_fails():
    s = make(policy="max-utilization", blocks=4, B=4, D=0)
    a, b = req(0, 8, out=20), req(1, 7, out=20)
    s.waiting.extend([a, b])
    s.schedule(0)  # both admitted: 2 blocks each, pool full
    for r in (a, b):
        r.state, r.n_host = State.GENERATION, r.prompt_len + 1
    s.kv.reserved[0] = 8  # a's next token needs a third block
    batch = s.schedule(1)
    assert b.pausing and b.num_preemptions == 1  # the newest is the victim
    assert [r.rid for r, _d in batch.gen] == []  # b's blocks go when nothing of it is in flight
