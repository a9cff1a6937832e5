"""The vLLM driver's steps as kvsim trace records (docs/trace.md), checked as they go.

Attention metadata is derived from vLLM's block tables the way its FlashInfer backend does
(vllm/v1/attention/backends/flashinfer.py at v0.33.0, `FlashInferMetadataBuilder.build` and
`_compute_flashinfer_kv_metadata`): per request seq_len = num_computed_tokens + scheduled
tokens, pages = cdiv(seq_len, B) leading entries of its block-table row, kv_indptr their
running sum, last_page_len = seq_len % B, or B where that is 0. FlashInfer's paged kernels are
the CSR interface kvsim calls `fa2`. Generation rows come first, as vLLM's batch puts its
decodes first (`split_decodes_and_prefills`); within each kind, rows keep the scheduler's
order (docs/vllm.md: where that differs from vLLM's persistent batch).

Block events come from the driver in the pool's own order. The trace tags everything after
step k's launch and before step k+1's with (k, "proc"): step k's processing (a "done" event,
then the frees of finished requests), then step k+1's scheduling (evictions, allocations,
hashes, prefix hits, a preemption's frees).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sim.trace.records import BlockEvent, RequestRecord, RowRecord, StepRecord


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Converter:
    def __init__(self, B: int, num_blocks: int, max_pos: int) -> None:
        self.B, self.usable, self.max_pos = B, num_blocks - 1, max_pos  # block 0: null block
        self.seq = 0

    def steps(self, objs: Iterable[dict]) -> Iterator[tuple[StepRecord, list[RowRecord],
                                                            list[BlockEvent]]]:
        """(step, rows, events) per launched step, its events in the checker's order: step 0's
        scheduling (sched), then after the launch (proc) its processing and the next step's
        scheduling. The driver's `{"events": ...}` objects (steps that scheduled nothing)
        are more of the latter."""
        held: dict | None = None
        pre: list[BlockEvent] = []
        tail: list[list] = []
        for o in objs:
            if "step" not in o:
                tail += o.get("events", [])
                continue
            if held is None:
                pre = self._events(0, "sched", tail + o["sched_events"])
            else:
                yield self._step(held, pre, tail + o["sched_events"])
                pre = []
            held, tail = o, []
        if held is not None:
            yield self._step(held, pre, tail)

    def _step(self, o: dict, pre: list[BlockEvent],
              tail: list[list]) -> tuple[StepRecord, list[RowRecord], list[BlockEvent]]:
        k = o["step"]
        after = ([self._event(k, "proc", ["done", -1, -1, 0, 0, 0], src=k)]
                 + self._events(k, "proc", o["proc_events"] + tail))
        return self.step_record(o), self.rows(o), pre + after

    def _events(self, step: int, phase: str, raw: list[list]) -> list[BlockEvent]:
        return [self._event(step, phase, e) for e in raw]

    def _event(self, step: int, phase: str, e: list, src: int = -1) -> BlockEvent:
        kind, block, req, ref, ntok, h = e
        self.seq += 1
        return BlockEvent(step=step, phase=phase, seq=self.seq - 1, event=kind, block=block,
                          request=req, refcount=ref, src=src, num_tokens=ntok, hash=h)

    def step_record(self, o: dict) -> StepRecord:
        rows = o["rows"]
        gen = sum(r["phase"] == "gen" for r in rows)
        t_sched, t_launch, t_start, t_end = o["t"]
        return StepRecord(
            step=o["step"], t_sched_ns=t_sched, t_launch_ns=t_launch, t_dev_start_ns=t_start,
            t_dev_end_ns=t_end, num_rows=len(rows), num_ctx=len(rows) - gen, num_gen=gen,
            num_tokens=sum(r["q"] for r in rows), backend="fa2", plan_q_len=-1,
            plan_batch=len(rows), plan_cache_size=1, blocks_used=self.usable - o["free"],
            blocks_free=o["free"], blocks_cached=o["cached"], graph_width=0,
            processed_step=o["step"])

    def rows(self, o: dict) -> list[RowRecord]:
        rows = sorted(o["rows"], key=lambda r: r["phase"] != "gen")  # stable: decodes first
        out, indptr = [], 0
        for i, r in enumerate(rows):
            c, q, B = r["c"], r["q"], self.B
            seq_len = c + q
            nb = _cdiv(seq_len, B)
            gen = r["phase"] == "gen"
            out.append(RowRecord(
                step=o["step"], row=i, request=r["request"], phase=r["phase"], q_len=q,
                draft_len=r["d"], first_gen=False, prev_in_flight=False,
                pages=tuple(r["blocks"][:nb]), kv_indptr=indptr,
                last_page_len=seq_len % B or B, kv_len=seq_len,
                append_pos=tuple(range(c, c + q)), rope_pos=tuple(range(c, c + q)),
                cached_host=c, kv_len_host=seq_len, committed=c, alloc=tuple(r["blocks"]),
                reserved=len(r["blocks"]) * B, shared_blocks=max(r["hit"], 0) // B,
                tokens=tuple(r["tokens"]), accepted=r["accepted"], new_tokens=r["new"],
                prev_new_tokens=r["prev_new"] if gen else -1, max_pos=self.max_pos))
            indptr += nb
        return out


def request_records(p: dict, final: dict) -> list[RequestRecord]:
    """The driver's account of each request (`final["requests"]`) with the payload's."""
    out = []
    for r, f in zip(p["requests"], final["requests"], strict=True):
        out.append(RequestRecord(
            request=r["id"], arrival_ns=r["arrival_ns"], prompt_len=len(r["prompt"]),
            output_len=r["output_len"], prompt_tokens=tuple(r["prompt"]),
            output_tokens=tuple(f["outputs"]), reused_tokens=f["reused"],
            first_token_ns=f["first_ns"], finish_ns=f["finish_ns"],
            finish_reason=f["reason"], num_preemptions=f["preemptions"],
            num_steps=f["steps"], accepted_drafts=f["accepted"],
            proposed_drafts=f["proposed"]))
    return out
