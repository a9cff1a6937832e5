"""Frozen records the engine emits and everything downstream consumes.

They mirror the Parquet tables of docs/trace.md column for column, so the online checker (fed
records) and the offline checker (fed a trace read back into records) run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMAT_VERSION = 3  # what the writer writes
# what the readers accept. 1: rows.parquet stores whole page lists; 2: delta-encoded page lists
# (sim/trace/delta.py); 3: as 2, with an xxh3-128 content digest instead of sha256 (digest.py)
READABLE_VERSIONS = (1, 2, 3)


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    t_sched_ns: int
    t_launch_ns: int
    t_dev_start_ns: int
    t_dev_end_ns: int
    num_rows: int
    num_ctx: int
    num_gen: int
    num_tokens: int
    backend: str  # "fa2" | "fa3" | "xqa"
    plan_q_len: int  # -1: plan built for this step
    plan_batch: int
    plan_cache_size: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    graph_width: int
    processed_step: int  # step whose results the host processed after launching this one


@dataclass(frozen=True, slots=True)
class RowRecord:
    step: int
    row: int
    request: int
    phase: str  # "ctx" | "gen"
    q_len: int
    draft_len: int
    first_gen: bool
    prev_in_flight: bool
    # engine: what the kernels are handed
    pages: tuple[int, ...]
    kv_indptr: int
    last_page_len: int
    kv_len: int
    append_pos: tuple[int, ...]
    rope_pos: tuple[int, ...]
    cached_host: int
    kv_len_host: int
    # truth: what is on the device
    committed: int
    alloc: tuple[int, ...]
    reserved: int
    shared_blocks: int
    tokens: tuple[int, ...]
    accepted: int  # -1 for ctx
    new_tokens: int
    prev_new_tokens: int
    max_pos: int


@dataclass(frozen=True, slots=True)
class BlockEvent:
    step: int
    phase: str  # "sched" | "proc"
    seq: int
    event: str  # alloc | reuse | copy | free | evict | rewind | hash
    block: int
    request: int
    refcount: int
    src: int = -1
    num_tokens: int = 0
    hash: int = 0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request: int
    arrival_ns: int
    prompt_len: int
    output_len: int
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    reused_tokens: int
    first_token_ns: int
    finish_ns: int
    finish_reason: str  # length | max_seq_len | rejected | unfinished
    num_preemptions: int
    num_steps: int
    accepted_drafts: int
    proposed_drafts: int


TOTALS = ("requests", "finished", "rejected", "output_tokens", "prompt_tokens",
          "reused_tokens", "gen_steps", "accepted", "proposed", "preemptions")


def count_request(totals: dict[str, int], rec: RequestRecord) -> None:
    """Add one finished request to a run's totals (all of TOTALS but `gen_steps`, which each
    engine counts its own way)."""
    totals["requests"] += 1
    totals["finished"] += rec.finish_reason in ("length", "max_seq_len")
    totals["rejected"] += rec.finish_reason == "rejected"
    totals["output_tokens"] += len(rec.output_tokens)
    totals["prompt_tokens"] += rec.prompt_len
    totals["reused_tokens"] += rec.reused_tokens
    totals["accepted"] += rec.accepted_drafts
    totals["proposed"] += rec.proposed_drafts
    totals["preemptions"] += rec.num_preemptions


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    step: int
    request: int
    message: str

    def __str__(self) -> str:
        return self.message
