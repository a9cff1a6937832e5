"""Scheduler (policy): FCFS admission, batch/token budgets, chunked prefill, capacity policies.

It decides who runs in the next step and asks the KV manager for the slots (check-then-commit);
it never touches the free queue. Generation rows are scheduled before context rows (TRT-LLM).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sim.config import Scenario
from sim.kv import KVManager, PrefixMatch
from sim.profiles import Switches
from sim.request import Request, State
from sim.trace.records import Violation


@dataclass(slots=True)
class Batch:
    ctx: list[tuple[Request, int, int]] = field(default_factory=list)  # (req, start, chunk)
    gen: list[tuple[Request, int]] = field(default_factory=list)  # (req, runtime draft len)

    def __len__(self) -> int:
        return len(self.ctx) + len(self.gen)


class Scheduler:
    def __init__(self, sc: Scenario, sw: Switches, kv: KVManager, overlap: bool) -> None:
        self.sc, self.sw, self.kv = sc, sw, kv
        self.B = sc.cache.tokens_per_block
        self.D = sc.spec.depth
        self.extra = sc.spec.extra_kv_tokens if sc.spec.mode == "mtp" else 0
        self.overlap = overlap
        self.max_pos = min(sc.model.max_position_embeddings, sc.blocks_per_seq * self.B)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.violations: list[Violation] = []
        # The block manager threw on the host ("No free blocks left"): nothing more launches.
        self.host_error = False

    # -- sizes ------------------------------------------------------------------------------
    @property
    def gen_reserve(self) -> int:
        """Slots reserved per generation step: the token and D draft placeholders
        (TRT-LLM KVCacheManager.prepare_resources: add_token x (1 + draft length))."""
        return 1 + self.D

    @property
    def ctx_extra(self) -> int:
        """The draft layers' extra KV slots, reserved once, at the first context chunk
        (prepare_resources: add_token x num_extra_kv_tokens); held until the request is freed."""
        return self.extra if self.sw.reserve_extra_kv else 0

    def reach_headroom(self) -> int:
        """Slots a request can hold past its final length: the step in flight and this one."""
        per = self.D + self.extra
        return 2 * per if self.overlap else per

    def blocks_to_completion(self, r: Request, headroom: int = 0) -> int:
        """TRT-LLM getRemainingBlocksToCompletion's total, ceil(min(P + max_new, window) / B),
        plus `headroom` slots (only kvsim's arrival guard passes any)."""
        left = r.output_len - r.outputs_done_at_admit()
        total = min(r.prefill_len + left, self.sc.limits.max_seq_len)
        return -(-(total + headroom) // self.B)

    def draft_len(self, r: Request, step: int) -> int:
        lens = self.sc.spec.runtime_draft_lens
        d = min(lens[step % len(lens)], self.D) if lens and self.D else self.D
        if not self.sw.draft_clamp:
            return d
        # Host upper bound on the device's committed count: the in-flight step may accept all.
        committed_max = r.n_host - 1 + (1 + self.D if r.inflight else 0)
        room = self.max_pos - committed_max  # writable positions from committed_max on
        if room < 1:
            return -1  # not even the bonus token fits: wait for the in-flight step
        if d and 1 + d + self.extra > room:
            # Shrink the drafts; with none left the draft layers write no extra KV either, so a
            # plain decode step always fits (found by the fuzzer: a request at the limit
            # with extra draft KV was skipped forever).
            d = max(0, room - 1 - self.extra)
        return d

    # -- the step ---------------------------------------------------------------------------
    def schedule(self, step: int) -> Batch:
        batch = Batch()
        if self.host_error:
            return batch
        budget = self.sc.scheduler.max_num_tokens
        for r in list(self.running):
            if len(batch) >= self.sc.scheduler.max_batch_size:
                break
            if r.state != State.GENERATION or r.finished or r.pausing:
                continue
            d = self.draft_len(r, step)
            if d < 0 or 1 + d > budget:
                continue
            if self._reserve_gen(r, step):
                batch.gen.append((r, d))
                budget -= 1 + d
            elif self.host_error:  # the exception ends the step's preparation: none launches
                for q, _d in batch.gen:
                    self.kv.rewind(q.rid, self.gen_reserve)
                return Batch()
        self._schedule_context(batch, budget, step)
        return batch

    def _reserve_gen(self, r: Request, step: int) -> bool:
        if self.kv.reserve(r.rid, self.gen_reserve):
            return True
        if self.sc.scheduler.policy == "guaranteed-no-evict":
            self._host_error(r, step)
            return False
        # max-utilization: pause the newest running request (possibly r) and let r wait a step.
        # The victim's blocks are released once no step of it is in flight, so retrying here
        # could not succeed: that loop was a livelock (found by the soak and the sweeps).
        victim = next((q for q in reversed(self.running) if not (q.pausing or q.finished)), None)
        if victim is not None:
            self.preempt(victim)
        return False

    def _schedule_context(self, batch: Batch, budget: int, step: int) -> None:
        limit = self.sc.scheduler.max_batch_size
        for r in self.running:
            if r.state == State.CONTEXT and not r.pausing and len(batch) < limit and budget > 0:
                budget -= self._chunk(batch, r, budget)
        contributed = self._contexts_contributing()
        delayed: list[Request] = []
        while self.waiting and len(batch) < limit and budget > 0:
            r = self.waiting[0]
            if self._beneficial_to_skip(r, contributed):
                delayed.append(self.waiting.popleft())
                continue
            if not self._admit(r, step, budget):
                break
            self.waiting.popleft()
            self.running.append(r)
            budget -= self._chunk(batch, r, budget)
        self.waiting.extendleft(reversed(delayed))

    # -- delaying a context for reuse (TRT-LLM capacityScheduler.cpp) -------------------------
    def _contexts_contributing(self) -> set[bytes]:
        """`prefillWithChunkedContextsAlreadyExecuting`: the first uncached block of every
        context past its first chunk (its blocks are stored when its context ends)."""
        keys = (self.kv.new_context_block(r.tokens, r.prefill_len) for r in self.running
                if r.state == State.CONTEXT and not r.pausing)
        return {k for k in keys if k is not None}

    def _beneficial_to_skip(self, r: Request, contributed: set[bytes]) -> bool:
        """`beneficialToSkip`: a new context whose first uncached block another context of
        this pass (or one in progress) is about to write waits, to reuse it instead."""
        key = self.kv.new_context_block(r.tokens, r.prefill_len)
        if key is None:
            return False
        if key in contributed:
            return True
        contributed.add(key)
        return False

    def _chunk(self, batch: Batch, r: Request, budget: int) -> int:
        left = r.prefill_len - r.ctx_pos
        cs = self.sc.scheduler.chunk_size or left
        n = min(left, cs, budget)
        if n < left and not self.sc.scheduler.chunk_size:
            return 0
        batch.ctx.append((r, r.ctx_pos, n))
        r.ctx_pos += n
        return n

    def _admit(self, r: Request, step: int, budget: int) -> bool:
        if not self.sc.scheduler.chunk_size and r.prefill_len > budget:
            return False
        match, hit = self.kv.match(r.tokens, r.prefill_len)
        if self.sc.scheduler.policy == "guaranteed-no-evict" and not self._gne_fits(r):
            return False
        slots = r.prefill_len + self.ctx_extra
        if not self.kv.admit(r.rid, match, slots):
            if match.partial_src < 0:
                return False
            # The copy target needs a block while its source is held: on a pool with no room
            # for that, reuse only the full blocks (found by the fuzzer: a request that fits an
            # empty pool waited forever for the transient extra block).
            match, hit = PrefixMatch(match.full, match.hashes), len(match.full) * self.B
            if not self.kv.admit(r.rid, match, slots):
                return False
        r.state, r.ctx_pos, r.committed = State.CONTEXT, hit, hit
        r.reused_tokens = max(r.reused_tokens, hit)
        return True

    def _host_error(self, r: Request, step: int) -> None:
        """Guaranteed-no-evict admitted r, yet its generation reservation found no free block:
        TRT-LLM's block manager throws on the host (WindowBlockManager::allocateBlock, "No
        free blocks left"), so the step is never launched and the run stops."""
        self.host_error = True
        self.violations.append(Violation(
            "HOST", step, r.rid,
            f"HOST step {step} req {r.rid}: reserving {self.gen_reserve} slots on C="
            f"{self.kv.reserved[r.rid]} needs {self.kv.blocks_needed(r.rid, self.gen_reserve)} "
            f"blocks, {self.kv.pool.num_free} free: the block manager throws (No free blocks "
            f"left) and the step is not launched"))

    def _gne_fits(self, r: Request) -> bool:
        """TRT-LLM GuaranteedNoEvictScheduler: the pool's free blocks less every running
        request's getRemainingBlocksToCompletion (no draft or overlap headroom, and no clamp at
        0: a request holding more than its total makes the pool look freer). With the
        `gne_headroom` switch, kvsim's own safe variant: headroom counted, clamped at 0."""
        head = self.reach_headroom() if self.sw.gne_headroom else 0
        left = [self.blocks_to_completion(q, head) - len(self.kv.blocks[q.rid])
                for q in self.running if self.kv.holds(q.rid)]
        promised = sum(max(0, x) for x in left) if self.sw.gne_headroom else sum(left)
        return self.blocks_to_completion(r, head) <= self.kv.pool.num_free - promised

    # -- lifecycle --------------------------------------------------------------------------
    def preempt(self, r: Request) -> None:
        """Pause r and recompute it later; its blocks go when no step of it is in flight."""
        r.pausing = True
        r.num_preemptions += 1

    def requeue(self, r: Request) -> None:
        self.running.remove(r)
        r.discard.update(r.inflight)
        r.state, r.pausing, r.freed = State.WAITING, False, False
        r.prefill_len, r.ctx_pos, r.committed = r.n_host, 0, 0
        r.prev_new_tokens, r.last_ctx_step = -1, -1
        self.waiting.appendleft(r)
