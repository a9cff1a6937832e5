"""vLLM's v1 scheduler, as vLLM 0.33.0's synchronous engine runs it
(vllm/v1/core/sched/scheduler.py `Scheduler.schedule`, `update_from_output`,
`update_draft_token_ids`, `_preempt_request`), for one full-attention group, FCFS.

There are no phases: each step gives every request tokens so its computed count catches up
with its known tokens plus drafts. One pass over the running requests (each allocates its
step's slots, preempting from the running tail until it fits or preempts itself), then, only
if nothing was preempted, the waiting queue (a fresh prefix lookup; the whole sequence must fit
the free blocks). Rejected drafts roll back only the computed count, never blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum

from sim.kv.vllm_manager import VllmKV
from sim.kv.vllm_pool import chain_hash


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class VRequest:
    """vllm/v1/request.py `Request`: the tokens known, the computed count, the drafts."""

    rid: int
    tokens: list[int]  # prompt, then every output token appended
    num_prompt: int
    max_tokens: int
    block_size: int
    lookahead: int  # tokens after a block its hash also covers (lookahead block hashes)
    caching: bool
    num_computed: int = 0
    spec: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    is_prefill_chunk: bool = False
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    def update_block_hashes(self) -> None:
        """kv_cache_utils.py `get_request_block_hasher`: full blocks only, and with lookahead
        L, only once the L tokens after a block exist (its hash covers them)."""
        if not self.caching:
            return
        B, L = self.block_size, self.lookahead
        start = len(self.block_hashes) * B
        parent = self.block_hashes[-1] if self.block_hashes else 0
        while start + B <= self.num_tokens - L:
            parent = chain_hash(parent, self.tokens[start:start + B + L])
            self.block_hashes.append(parent)
            start += B


@dataclass(frozen=True, slots=True)
class VConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    max_model_len: int
    num_spec_tokens: int


@dataclass
class Scheduled:
    """`SchedulerOutput`, the parts a driver reads: tokens and drafts per request, in order."""

    tokens: dict[VRequest, int] = field(default_factory=dict)
    drafts: dict[VRequest, list[int]] = field(default_factory=dict)
    preempted: list[VRequest] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.tokens.values())


class VllmScheduler:
    def __init__(self, cfg: VConfig, kv: VllmKV) -> None:
        self.cfg, self.kv = cfg, kv
        self.k = cfg.num_spec_tokens
        self.waiting: deque[VRequest] = deque()
        self.running: list[VRequest] = []
        self.finished_ids: set[int] = set()  # finished since the last schedule()
        # this step's running pass: did it schedule a prefill chunk, did it schedule anyone
        self.prefill_running = False
        self.ran = False

    def add_request(self, r: VRequest) -> None:
        self.waiting.append(r)

    def reset_prefix_cache(self) -> bool:
        """`reset_prefix_cache()` (running requests kept): done only when no block is held."""
        return self.kv.pool.reset_prefix_cache()

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running or self.finished_ids)

    # -- schedule ---------------------------------------------------------------------------
    def schedule(self) -> Scheduled:
        out = Scheduled()
        budget = self.cfg.max_num_batched_tokens
        eligible = len(self.running) + len(self.waiting)
        # long_prefill_token_threshold caps a prefill only when another request could use the
        # budget it leaves
        thr = self.cfg.long_prefill_token_threshold if eligible > 1 else 0
        budget = self._schedule_running(out, budget, thr)
        if not out.preempted:
            self._schedule_waiting(out, budget, thr)
        for r, n in out.tokens.items():  # _update_after_schedule
            r.num_computed += n
            r.is_prefill_chunk = r.num_computed < r.num_tokens
        self.finished_ids = set()
        return out

    def _schedule_running(self, out: Scheduled, budget: int, thr: int) -> int:
        i = 0
        prefill = False
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = len(r.tokens) + len(r.spec) - r.num_computed
            if 0 < thr < n:
                n = thr
            n = min(n, budget, self.cfg.max_model_len - r.num_computed - 1)
            if n <= 0:
                i += 1
                continue
            if not self._allocate_or_preempt(r, n, out):
                break
            prefill |= r.is_prefill_chunk
            out.tokens[r] = n
            budget -= n
            i += 1
            if r.spec:
                m = n + r.num_computed - r.num_tokens
                if m > 0:
                    out.drafts[r] = r.spec[:m]
                r.spec = []
        self.prefill_running, self.ran = prefill, bool(out.tokens)
        return budget

    def _allocate_or_preempt(self, r: VRequest, n: int, out: Scheduled) -> bool:
        """Preempt the running tail until r's slots fit, or r preempted itself."""
        while not self.kv.allocate_slots(r, n, lookahead=self.k):
            victim = self.running.pop()
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is r:
                return False
        return True

    def preempt(self, r: VRequest) -> None:
        """`_preempt_request`: free its blocks now; recompute it from the waiting queue's head."""
        self.kv.free(r.rid)
        r.status = Status.PREEMPTED
        r.num_computed = 0
        r.spec = []
        r.num_preemptions += 1
        self.waiting.appendleft(r)

    def _schedule_waiting(self, out: Scheduled, budget: int, thr: int) -> None:
        while budget > 0 and self.waiting and len(self.running) < self.cfg.max_num_seqs:
            r = self.waiting[0]
            hit, computed = self.kv.computed_blocks(r)
            n = r.num_tokens - computed
            pad = self._pads(n, computed, out)
            if pad:
                if 1 + self.k > budget:
                    break
                n = 1 + self.k
            if 0 < thr < n:
                n = thr
            n = min(n, budget)
            # vLLM asserts here; the adapter refuses a threshold below 1 + k (docs/vllm.md)
            assert not pad or n == 1 + self.k, "a padded step was cut: refused input got here"
            if not self.kv.allocate_slots(r, n, hit, self.k, admit=True):
                break
            self.waiting.popleft()
            self.running.append(r)
            out.tokens[r] = n
            budget -= n
            r.status, r.num_computed = Status.RUNNING, computed
            if pad:
                out.drafts[r] = [-1] * self.k

    def _pads(self, n: int, computed: int, out: Scheduled) -> bool:
        """A resumed request with one token left is padded to a full speculative step (so the
        batch stays uniform decode): 1 + k tokens, k placeholder drafts."""
        return (self.k > 0 and n == 1 and not self.prefill_running
                and (self.ran or computed > 0)
                and computed + 1 + self.k + 1 <= self.cfg.max_model_len)

    # -- after the step ---------------------------------------------------------------------
    def update_from_output(self, out: Scheduled, sampled: dict[VRequest, list[int]]
                           ) -> list[VRequest]:
        """Roll back rejected drafts, append the sampled tokens, hash blocks a decode filled,
        free what finished. Returns the finished requests, in the step's order."""
        done: list[VRequest] = []
        for r in out.tokens:
            got = sampled.get(r, [])
            drafts = out.drafts.get(r)
            if drafts and got and r.num_computed > 0:
                r.num_computed -= len(drafts) - max(len(got) - 1, 0)
            if not got:
                continue
            running = r.status == Status.RUNNING
            stopped = self._append(r, got)
            if running and self.k > 0:
                self.kv.cache_blocks(r, r.num_computed)
            if stopped:
                self.kv.free(r.rid)
                self.finished_ids.add(r.rid)
                done.append(r)
        if done:
            self.running = [r for r in self.running if r.status != Status.FINISHED]
        return done

    def _append(self, r: VRequest, got: list[int]) -> bool:
        """`_update_request_with_output` + `check_stop` (max_tokens, max_model_len)."""
        for i, t in enumerate(got, 1):
            r.tokens.append(t)
            r.update_block_hashes()
            if r.num_tokens >= self.cfg.max_model_len or r.num_output >= r.max_tokens:
                r.num_computed -= len(got) - i
                r.status = Status.FINISHED
                return True
        return False

    def update_draft_token_ids(self, drafts: dict[VRequest, list[int]]) -> None:
        for r, d in drafts.items():
            if r.status == Status.FINISHED:
                continue
            r.spec = [] if r.is_prefill_chunk else list(d)
