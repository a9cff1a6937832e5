"""Tiny record builders for the checker tests (no tests here).

The default world: B=4, 16 blocks; request 0 prefilled 6 tokens into blocks (1, 2) at step 0,
so a default generation row at step 1 (committed 6, q_len 2, pages (1, 2)) is clean.
"""

from __future__ import annotations

from dataclasses import replace

from sim.check import StepChecker
from sim.trace.records import BlockEvent, RowRecord, StepRecord, Violation

B = 4
MODEL = {"tokens_per_block": B, "num_blocks": 16, "null_block": False, "num_q_heads": 4,
         "num_kv_heads": 1, "head_dim": 8, "dtype": "bfloat16", "max_position_embeddings": 64}

_GEN = RowRecord(step=1, row=0, request=0, phase="gen", q_len=2, draft_len=1, first_gen=False,
                 prev_in_flight=False, pages=(1, 2), kv_indptr=0, last_page_len=4, kv_len=8,
                 append_pos=(6, 7), rope_pos=(6, 7), cached_host=6, kv_len_host=8, committed=6,
                 alloc=(1, 2), reserved=8, shared_blocks=0, tokens=(5, 6), accepted=1,
                 new_tokens=2, prev_new_tokens=-1, max_pos=64)


def gen(**kw: object) -> RowRecord:
    return replace(_GEN, **kw)  # type: ignore[arg-type]


def ctx(**kw: object) -> RowRecord:
    base = dict(step=0, phase="ctx", q_len=6, draft_len=0, last_page_len=2, kv_len=6,
                append_pos=tuple(range(6)), rope_pos=tuple(range(6)), cached_host=0,
                kv_len_host=6, committed=0, tokens=tuple(range(6)), accepted=-1,
                new_tokens=6)
    base.update(kw)
    return replace(_GEN, **base)  # type: ignore[arg-type]


def step(k: int, rows: int = 1, backend: str = "fa2", used: int = 2, usable: int = 16,
         **kw: object) -> StepRecord:
    base = dict(step=k, t_sched_ns=0, t_launch_ns=0, t_dev_start_ns=0, t_dev_end_ns=0,
                num_rows=rows, num_ctx=0, num_gen=rows, num_tokens=2 * rows, backend=backend,
                plan_q_len=-1, plan_batch=rows, plan_cache_size=1, blocks_used=used,
                blocks_free=usable - used, blocks_cached=0, graph_width=0, processed_step=k)
    base.update(kw)
    return StepRecord(**base)  # type: ignore[arg-type]


class Events:
    """BlockEvents with a running seq."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, k: int, event: str, block: int, request: int, refcount: int,
                 phase: str = "sched", **kw: object) -> BlockEvent:
        self.seq += 1
        return BlockEvent(k, phase, self.seq, event, block, request, refcount, **kw)  # type: ignore[arg-type]


def feed(chk: StepChecker, events: list[BlockEvent]) -> list[Violation]:
    out: list[Violation] = []
    for e in events:
        out += chk.block_event(e)
    return out


def prefilled(backend: str = "fa2", model: dict | None = None) -> tuple[StepChecker, Events]:
    """A checker after step 0: req 0's 6-token prompt in blocks (1, 2), all clean."""
    chk, ev = StepChecker(model or MODEL), Events()
    assert feed(chk, [ev(0, "alloc", 1, 0, 1), ev(0, "alloc", 2, 0, 1)]) == []
    usable = chk.m.num_blocks - int(chk.m.null_block)
    assert chk.launch(step(0, backend=backend, usable=usable), [ctx()]) == []
    assert feed(chk, [ev(0, "done", -1, -1, 0, phase="proc", src=0)]) == []  # step 0 processed
    return chk, ev


def only(out: list[Violation], inv: str) -> list[str]:
    return [v.message for v in out if v.invariant == inv]
