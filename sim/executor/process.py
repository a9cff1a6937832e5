"""Host-side bookkeeping: arrivals, processing a finished step, finishing and freeing requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from sim.request import Request, State
from sim.trace.records import TOTALS, RequestRecord, RowRecord, Violation, count_request
from sim.workload import RequestSpec

if TYPE_CHECKING:
    from sim.engine import Engine, Launched


class Processor:
    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.last_processed = -1
        self.violations: list[Violation] = []
        self.on_request: Callable[[RequestRecord], None] = lambda rec: None
        self.totals = dict.fromkeys(TOTALS, 0)
        self.slack = 2 * (eng.sc.spec.depth + eng.sc.spec.extra_kv_tokens) + 2

    # -- arrivals ---------------------------------------------------------------------------
    def arrive(self, spec: RequestSpec) -> None:
        eng = self.eng
        P = len(spec.prompt)
        outs = eng.tok_rng.integers(0, 32000, size=spec.output_len + self.slack, dtype=np.int32)
        r = Request(spec.rid, spec.arrival_ns, P, spec.output_len,
                    np.concatenate([np.asarray(spec.prompt, np.int32), outs]),
                    accept_scale=eng.acc.request_scale(), prefill_len=P, n_host=P)
        eng.requests[r.rid] = r
        if self._unservable(r):
            self._finish(r, "rejected", spec.arrival_ns)
            self._emit(r)
            del eng.requests[r.rid]
            return
        eng.sched.waiting.append(r)

    def _unservable(self, r: Request) -> bool:
        """A request that could not complete even alone on an empty pool is rejected on arrival:
        admitted, it would stall the FCFS queue (guaranteed-no-evict) or preempt itself forever
        (max-utilization) — both found by the fuzzer."""
        sc = self.eng.sc
        sched = self.eng.sched
        need = sched.blocks_to_completion(r, sched.reach_headroom())
        too_long = r.prompt_len >= sc.limits.max_seq_len
        no_chunk = not sc.scheduler.chunk_size and r.prompt_len > sc.scheduler.max_num_tokens
        return too_long or no_chunk or need > self.eng.kv.pool.num_usable

    # -- processing -------------------------------------------------------------------------
    def process(self, done: Launched) -> None:
        now = done.dev_end
        self.eng.events.emit("done", -1, -1, 0, src=done.step)
        for row in done.rows:
            r = self.eng.requests[row.request]
            r.inflight.remove(done.step)
            if done.step in r.discard:  # launched for an admission that was since preempted
                r.discard.discard(done.step)
                continue
            if not (r.finished or r.freed or r.pausing):
                self._apply(r, row, now)
            self._maybe_release(r, now)
        self.last_processed = done.step

    def _apply(self, r: Request, row: RowRecord, now: int) -> None:
        eng, kv = self.eng, self.eng.kv
        if row.phase == "gen":
            r.n_host += row.new_tokens
            kv.rewind(r.rid, eng.sched.gen_reserve - row.new_tokens)
        elif row.committed + row.q_len >= r.prefill_len:
            r.n_host = r.prefill_len + 1  # the context forward's token
            if r.first_token_ns < 0:
                r.first_token_ns = now
            kv.register(r.rid, r.tokens, r.prefill_len)
        else:
            return
        lim = min(r.prompt_len + r.output_len, eng.sc.limits.max_seq_len)
        if r.n_host >= lim:
            r.n_host = lim
            reason = "length" if lim == r.prompt_len + r.output_len else "max_seq_len"
            self._finish(r, reason, now)
        elif row.phase == "gen" and r.inflight == []:
            self._check_i18(r, row.step)

    def _check_i18(self, r: Request, step: int) -> None:
        """At idle C == N - 1 plus the extra draft KV reserved once at context."""
        C = self.eng.kv.reserved[r.rid]
        extra = self.eng.sched.ctx_extra
        if C != r.n_host - 1 + extra:
            plus = f"+{extra}" if extra else ""
            self.violations.append(Violation(
                "I18", step, r.rid, f"I18 step {step} req {r.rid}: after processing, reserved "
                f"C={C} but N-1{plus}={r.n_host - 1 + extra} with no step in flight"))

    def _finish(self, r: Request, reason: str, now: int) -> None:
        r.finished, r.finish_reason, r.finish_ns = True, reason, now
        r.late_finish = bool(r.inflight)  # a step launched before the host knew it was done
        r.state = State.FINISHED

    def _maybe_release(self, r: Request, now: int) -> None:
        sw = self.eng.sw
        if not (r.finished or r.pausing) or (r.inflight and sw.defer_free_in_flight):
            return
        if r.freed:
            if not r.inflight and r.finished:
                self.eng.requests.pop(r.rid, None)
            return
        deferred = r.finished and r.late_finish
        self._free(r)
        if deferred and not sw.single_free:
            # TRT-LLM #12816: the in-flight step's response terminates the request once more.
            for b in r.tokens_blocks:
                self.eng.events.emit("free", b, r.rid, self.eng.kv.pool.refcount[b])
        if r.pausing and not r.finished:
            self.eng.sched.requeue(r)

    def _free(self, r: Request) -> None:
        eng = self.eng
        if r.finished:  # TRT-LLM's releaseBlocks stores the partly filled last block too
            eng.kv.register(r.rid, r.tokens, min(r.committed, r.n_host - 1), tail=True)
        r.tokens_blocks = tuple(eng.kv.blocks[r.rid])
        eng.kv.free(r.rid)
        r.freed = True
        if r.finished:
            eng.sched.running.remove(r)
            self._emit(r)
            if not r.inflight:
                del eng.requests[r.rid]

    def halt(self) -> None:
        """The host threw (a failed reservation): every running request ends unfinished and
        its blocks are released, as the executor's error path terminates them."""
        now = int(self.eng.env.now)
        for r in list(self.eng.sched.running):
            if not r.freed:
                self._finish(r, "unfinished", now)
                self._maybe_release(r, now)

    def after_schedule(self) -> None:
        """Requests the scheduler paused or that finished: release what may be released now."""
        for r in list(self.eng.sched.running):
            if (r.pausing or r.finished) and not r.freed:
                self._maybe_release(r, int(self.eng.env.now))

    # -- end --------------------------------------------------------------------------------
    def take_violations(self) -> None:
        self.after_schedule()
        self.violations.extend(self.eng.sched.violations)
        self.eng.sched.violations.clear()

    def stalled(self, step: int) -> None:
        head = (self.eng.sched.waiting or self.eng.sched.running)[0]
        self.violations.append(Violation(
            "LIVENESS", step, head.rid,
            f"LIVENESS step {step} req {head.rid}: requests are waiting, nothing runs or is in "
            f"flight, and nothing can be scheduled ({self.eng.kv.pool.num_free} blocks free)"))

    def finish_all(self) -> None:
        for rid in sorted(self.eng.requests):
            r = self.eng.requests[rid]
            if not r.freed:
                self._emit(r)

    def _emit(self, r: Request) -> None:
        rec = self._record(r)
        count_request(self.totals, rec)
        self.totals["gen_steps"] += rec.num_steps
        self.on_request(rec)

    def _record(self, r: Request) -> RequestRecord:
        outs = r.tokens[r.prompt_len:max(r.prompt_len, r.n_host)]
        return RequestRecord(
            r.rid, r.arrival_ns, r.prompt_len, r.output_len,
            tuple(int(t) for t in r.tokens[:r.prompt_len]), tuple(int(t) for t in outs),
            r.reused_tokens, r.first_token_ns, r.finish_ns, r.finish_reason, r.num_preemptions,
            r.gen_steps, r.accepted_drafts, r.proposed_drafts)
