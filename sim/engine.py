"""The engine loop in simulated time (the only simpy user).

Iteration k, overlap on (docs/design.md §3.4):

    host:   | schedule k | build k | launch k | wait k-1, process k-1 | schedule k+1 | ...
    device:              |   ... k-1 ...    |       k        |           k+1

Overlap off: the host waits for k and processes it before scheduling k+1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import simpy

from sim.config import Scenario
from sim.cost import build_cost_model
from sim.executor.metadata import MetadataBuilder
from sim.executor.process import Processor
from sim.executor.rows import build_rows
from sim.kv import EventLog, KVManager
from sim.profiles import Switches
from sim.request import Request, State
from sim.sched.scheduler import Batch, Scheduler
from sim.spec import Acceptance
from sim.trace.records import RowRecord, StepRecord
from sim.workload import RequestSpec


@dataclass(slots=True)
class Launched:
    step: int
    batch: Batch
    rows: list[RowRecord]
    record: dict
    dev_end: int


class Engine:
    def __init__(self, sc: Scenario, sw: Switches, specs: Iterator[RequestSpec],
                 sink: Callable[..., None], record_events: bool = True,
                 detail: bool = True) -> None:
        seeds = np.random.SeedSequence(sc.seed).spawn(3)
        self.sc, self.sw = sc, sw
        self.overlap = sc.overlap.enabled
        self.B = sc.cache.tokens_per_block
        self.events = EventLog(record_events)
        self.kv = KVManager(sc.cache.num_blocks, self.B, sc.cache.reuse, self.events,
                            sw.null_block, sw.nocopy_exclusive, sw.reuse_tree)
        self.sched = Scheduler(sc, sw, self.kv, self.overlap)
        extra = sc.spec.extra_kv_tokens if sc.spec.mode == "mtp" else 0
        self.md = MetadataBuilder(sw, self.kv, self.B, extra, self.sched.max_pos,
                                  sc.scheduler.max_batch_size * sc.blocks_per_seq)
        self.acc = Acceptance(sc.spec.acceptance, np.random.default_rng(seeds[0]))
        self.tok_rng = np.random.default_rng(seeds[1])
        self.cost = build_cost_model(sc.cost)
        self.proc = Processor(self)
        self.specs = specs
        self.detail = detail  # build page/token lists (someone reads them: trace or checker)
        self.sink = sink
        self.env = simpy.Environment()
        self.step = 0
        self.dev_free = 0
        self.pending: Launched | None = None  # launched, record not yet handed to the sink
        self.next_spec: RequestSpec | None = next(specs, None)
        self.requests: dict[int, Request] = {}

    # -- arrivals ---------------------------------------------------------------------------
    def _arrive(self, now: int) -> None:
        while self.next_spec is not None and self.next_spec.arrival_ns <= now:
            self.proc.arrive(self.next_spec)
            self.next_spec = next(self.specs, None)

    def _alive(self) -> bool:
        return bool(self.sched.running or self.sched.waiting)

    # -- loop -------------------------------------------------------------------------------
    def run(self) -> None:
        self.env.process(self._loop())
        self.env.run()
        self._flush()
        self.proc.finish_all()

    def _loop(self):  # type: ignore[no-untyped-def]
        prev: Launched | None = None
        free_at_stall = -1  # pool state when nothing could be scheduled last time
        while True:
            self._arrive(self.env.now)
            t_sched = self.env.now
            batch = self.sched.schedule(self.step)
            self.proc.take_violations()
            if self.sched.host_error:  # the host threw: what is in flight lands, then it stops
                if prev is not None:
                    yield from self._process(prev)
                self.proc.halt()
                return
            if not len(batch):
                if prev is not None:
                    yield from self._process(prev)
                    prev = None
                elif self.next_spec is not None:
                    yield self.env.timeout(max(0, self.next_spec.arrival_ns - self.env.now))
                elif self._alive():
                    if self.kv.pool.num_free != free_at_stall:
                        # a preemption just released blocks: scheduling again may succeed
                        # (found by the fuzzer: vLLM-style self-preemption looked like a stall)
                        free_at_stall = self.kv.pool.num_free
                        continue
                    self.proc.stalled(self.step)
                    return
                else:
                    return
                continue
            free_at_stall = -1  # progress: a later empty attempt starts a fresh stall check
            yield self.env.timeout(self.cost.host_ns(len(batch), 0))
            cur = self._launch(batch, t_sched)
            if self.overlap:
                if prev is not None:
                    yield from self._process(prev)
                prev = cur
            else:
                yield from self._process(cur)

    def _process(self, done: Launched):  # type: ignore[no-untyped-def]
        if done.dev_end > self.env.now:
            yield self.env.timeout(done.dev_end - self.env.now)
        self.proc.process(done)

    def _launch(self, batch: Batch, t_sched: int) -> Launched:
        k = self.step
        rows = build_rows(k, batch, self.md, self.acc, self.sched.max_pos, self.detail)
        self._flush()
        now = int(self.env.now)
        q = np.fromiter((r.q_len for r in rows), np.int64, len(rows))
        kvl = np.fromiter((r.kv_len for r in rows), np.int64, len(rows))
        ctx = np.fromiter((r.phase == "ctx" for r in rows), bool, len(rows))
        start = max(now, self.dev_free)
        end = start + self.cost.device_ns(q, kvl, ctx)
        self.dev_free = end
        gen_w = max((r.q_len for r in rows if r.phase == "gen"), default=0)
        plan = self.md.plan(gen_w, len(rows))
        pool = self.kv.pool
        rec = dict(step=k, t_sched_ns=t_sched, t_launch_ns=now, t_dev_start_ns=start,
                   t_dev_end_ns=end, num_rows=len(rows), num_ctx=len(batch.ctx),
                   num_gen=len(batch.gen), num_tokens=int(q.sum()), backend=self.sw.backend,
                   plan_q_len=plan[0], plan_batch=plan[1], plan_cache_size=plan[2],
                   blocks_used=pool.num_used, blocks_free=pool.num_free,
                   blocks_cached=pool.num_cached_free, graph_width=0, processed_step=-1)
        for r, _s, _c in batch.ctx:
            r.inflight.append(k)
            if r.ctx_pos >= r.prefill_len:
                r.state, r.last_ctx_step = State.GENERATION, k
        for r, _d in batch.gen:
            r.inflight.append(k)
        self.pending = Launched(k, batch, rows, rec, end)
        self.events.step, self.events.phase = k, "proc"
        self.step += 1
        return self.pending

    def _flush(self) -> None:
        """Hand the previous launch to the sink once everything it caused is known."""
        p, self.pending = self.pending, None
        if p is not None:
            p.record["processed_step"] = self.proc.last_processed
            self.sink(StepRecord(**p.record), p.rows, self.events.drain())
