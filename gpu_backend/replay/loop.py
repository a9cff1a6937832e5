"""The replay loop shared by both backends: trace -> pool -> kernels -> verdicts per row.

Per step k:
  1. apply the block events between launch k-1 and launch k (alloc/evict poison, copies); then
     the worst legal device timing under overlap: step k runs only after the host events up to its
     `done` event, so the pages `free`d in that window by a request in step k (and pages freed
     twice while another request or the prefix cache holds them) are poisoned before k runs
     (`events.in_flight_poison`: the pages were handed out and refilled while k was in flight);
  2. build K/V/Q from (token, engine RoPE position), truth K/V and Q from (token, true position);
     the engine's K/Q at a position past its RoPE table (max_position_embeddings) are NaN;
  3. kernels: append at the engine's positions through the engine's table, then attention with
     the engine's metadata (backend-specific: FlashInfer on the GPU, access model on the CPU);
  4. checksum pages, fp32 reference over the truth, per-token errors (kept on the device);
  5. the slots of rejected drafts (the rewind) become poison: applied at the start of the next
     step, with its block events (one launch on the GPU; nothing reads the pool in between).

Everything that depends on the trace alone is built ahead on the host (`prepare`) and uploaded a
chunk of steps at a time, so a step only queues device work: no numpy, no host-device syncs. The
device's per-token errors and moved pages are copied back every EARLY steps, behind those steps'
work, and turned into verdicts on the host (`verdicts.judge`) once they have arrived, while the
device runs the steps after them; with more than LEAD read-backs on their way the host waits for
the oldest; a long prompt step (SEND_TOKENS query tokens) is read back alone, right after it.
Toward the end a read-back holds at most one step more than are left after it (their sizes
halve), so the host, once it has queued the last step, judges most of them while the device still
runs the last ones. The host waits for all of it every FLUSH steps and at the end. Before
either wait, the loop's own preparation gets ahead by as many steps as the device's work lets
it (`ReadySteps`, at most BANK).
"""

from __future__ import annotations

import functools
import gc
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass

import torch

from gpu_backend.device import reference as reference_mod
from gpu_backend.device.graphs import ArenaResults, StepGraphs
from gpu_backend.device.pool import KernelFault, Kernels, KVPool, content_kv_q, torch_dtype
from gpu_backend.device.reference import TruthStore, beside, join, reference, token_errors
from gpu_backend.device.watch import FullWatch, IncrementalWatch, Unseen, Watch
from gpu_backend.host.prepare import HostState, Prepared, complete, prepared_steps, replayed
from gpu_backend.host.truth import truth_shape
from gpu_backend.trace import TraceData
from gpu_backend.verdicts import DEFAULT_TOL, Pending, ReplayResult, Sent, drain, send, settle
from sim import heap

GUARD_PAGES = 16
# steps per read-back of the verdict data, queued behind them: judged while the device runs
# the steps after them, not after it has finished; fewer, larger read-backs cost the host less
EARLY = 16
# read-backs queued and not yet judged, at most: the host then waits for the oldest (unbounded,
# it ran ahead of a device-bound replay and judged those steps after the device had finished)
LEAD = 2
FLUSH = 256  # steps between waits for every read-back (one host-device sync each)
# query tokens after which the pending steps are read back at once (a long prompt step alone),
# to be judged while the device runs the steps queued behind them, not with the device idle
SEND_TOKENS = 1 << 16
# steps the loop's own preparation may get ahead while the host would wait for the device
# (`ReadySteps`; and `BANK_WORDS` words): a long step's device time (the prompts' step) then goes
# to preparing the steps after it instead of to a sync
BANK = 128


def replay(trace: TraceData, kernels: Kernels, device: torch.device | str, tol: float = DEFAULT_TOL,
           skip: dict[int, str] | None = None,
           on_step: Callable[[int, str], None] | None = None,
           watch: str = "incremental") -> ReplayResult:
    """Replay every step of `trace`. `skip` maps steps not to run to a fault message (--isolate);
    `on_step(step, "start"|"done")` is called around each step (the child's progress report).
    watch: how page changes are found (`gpu_backend.device.watch`): "incremental" (the step's target
    pages, the whole pool every few steps; replayed again with "full" if a page changed
    elsewhere) or "full" (the whole pool every step). The verdicts are the same."""
    # with glibc's defaults much of the preparation's arrays is new memory every step, a page
    # fault each 4 KiB: a 64 x 2k prompts' step is prepared in 0.8x the time here (`sim.heap`).
    # Not trimmed at the end: the trim took the wall 1-2 ms after the device had finished, and
    # the process keeps the memory for its next use
    with _frozen_heap(), heap.kept(trim=False):
        if watch == "incremental" and not skip:
            try:
                return _replay(trace, kernels, device, tol, {}, on_step, IncrementalWatch)
            except Unseen as e:
                res = _replay(trace, kernels, device, tol, {}, on_step, FullWatch)
                res.watch = f"full (incremental found {e})"
                return res
        return _replay(trace, kernels, device, tol, skip or {}, on_step, FullWatch)


@contextmanager
def _frozen_heap() -> Iterator[None]:
    """The objects that exist before the replay (the trace, torch's, numba's compiled code: some
    200k) are left out of the garbage collector's full collections until it ends. A full
    collection over them took 20-60 ms on a 2-core development machine, inside some step, and
    numba's first compile of `gpu_backend.host.layout_jit` doubled that heap. Nothing is lost:
    unfreeze
    hands them back to the oldest generation."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _replay(trace: TraceData, kernels: Kernels, device: torch.device | str, tol: float,
            skip: dict[int, str], on_step: Callable[[int, str], None] | None,
            make_watch: Callable[[KVPool, bool], Watch]) -> ReplayResult:
    m = trace.model
    dt = torch_dtype(m.dtype)
    slots, span, last = truth_shape(trace)
    truth = TruthStore(slots, span, m.num_kv_heads, m.head_dim, dt, device,
                       side=_reference_beside(kernels, device))
    state = HostState(trace, GUARD_PAGES, m.max_position, last=last,
                      free=list(range(slots))[::-1], together=reference_mod.together(device))

    @functools.cache
    def rig() -> Rig:
        pool = KVPool(m.num_blocks, GUARD_PAGES, m.page_size, m.num_kv_heads, m.head_dim, dt,
                      device)
        watch = make_watch(pool, True)  # nothing has written it yet
        make = getattr(kernels, "step_graphs", None)
        graphs = make(pool, truth, m.num_q_heads, watch) if callable(make) and not skip else None
        state.graphs = graphs.planner if graphs is not None else None  # the steps after it
        return Rig(pool, watch, graphs)

    res = ReplayResult(kernels.name, str(trace.path), tol)
    # the first step deferred: its content and reference run before the rest is prepared
    with closing(prepared_steps(trace, state, device, defer=True)) as steps:
        ahead = ReadySteps(steps, BANK)
        _loop(trace, kernels, truth, rig, ahead, res, skip, on_step)
    r = rig()
    res.watch = r.watch.name
    res.prepare_s, res.prepare_step_s = state.seconds, state.step_seconds
    res.stats["prepared_ahead"] = ahead.pulled
    stats = getattr(kernels, "stats", None)
    if callable(stats):
        res.stats |= stats()
    if r.graphs is not None:
        res.stats |= r.graphs.stats()
    return res


@dataclass
class Rig:
    """The pool, the watch over its pages and the CUDA graphs (None: eager). With the loop's
    own preparation it is made once the first step's content and reference are queued: nothing
    before them reads it, so its host time leaves the serial start and its device work (the
    pool's poison, the watch's first sums) runs beside the reference."""
    pool: KVPool
    watch: Watch
    graphs: StepGraphs | None


def _reference_beside(kernels: Kernels, device: torch.device | str) -> bool:
    """Whether the reference gets a stream of its own (`reference.beside`): on CUDA, unless the
    kernels are timed launch by launch, whose events would then time the reference's share of
    the device too."""
    timed = getattr(kernels, "timing", False) or getattr(kernels, "attn_timing", False)
    return torch.device(device).type == "cuda" and not timed


def _loop(trace: TraceData, kernels: Kernels, truth: TruthStore, rig: Callable[[], Rig],
          steps: ReadySteps, res: ReplayResult, skip: dict[int, str],
          on_step: Callable[[int, str], None] | None) -> None:
    """Every prepared step: queue its device work, read back and judge the steps before it.
    Where the host would wait for the device, it prepares steps ahead instead (`ReadySteps`).
    rig: the pool, watch and graphs, made on its first call (`Rig`)."""
    pending: list[Pending] = []
    sent: deque[Sent] = deque()
    tokens = since = 0
    left = len(replayed(trace))  # the steps the loop runs
    # the rig's, once it is made: the first step runs eagerly (a graph step's fallback)
    graphs: StepGraphs | None = None
    nxt = steps.next()
    while nxt is not None:
        p = nxt
        if on_step:
            on_step(p.step.step, "start")
        got, known = None, False
        if graphs is not None and p.graph is not None:
            nxt, known = steps.next(), True  # whether p is the last
            got = _graph_step(graphs, rig(), p, nxt)
        if got is None:
            # the kernels queued before the next step is prepared: the prompts' step's device
            # work starts one step's preparation sooner (its check of the next step's touched
            # pages comes after, as before)
            finish = _eager_step(rig, truth, kernels, p, skip, trace.model.num_q_heads)
            if not known:
                nxt = steps.next()
            got = finish(nxt)
        r = rig()  # made by the first step's events
        graphs, watch = r.graphs, r.watch
        pending.append(got)
        tokens += p.b.num_tokens
        since += 1
        left -= 1
        wait_all = since >= FLUSH or nxt is None
        # toward the end, read-backs of fewer steps (module docstring)
        if wait_all or len(pending) >= min(EARLY, left) or tokens >= SEND_TOKENS:
            sent.append(send(pending, watch.stale() if wait_all else None))
            tokens = 0
            if graphs is not None:
                graphs.seal()  # the next read-back's steps in an arena of their own
        if graphs is not None and nxt is not None:
            graphs.ahead(nxt)  # while the device runs p (and a settle below waits for it)
        if wait_all:
            steps.fill(sent[-1].ready if sent else None)
            settle(res, sent, watch)
            since = 0
        else:
            if len(sent) > LEAD:
                steps.fill(sent[0].ready)
            drain(res, sent, watch, LEAD)
        if on_step:
            on_step(p.step.step, "done")


def _apply_events(pool: KVPool, p: Prepared) -> None:
    """The last step's rewind and this step's block events (`events.join_rewind`)."""
    for kind, a, b, n in p.ops:
        if kind == "nan":
            pool.poison_rows(p.dv[f"ev{a}"])
        else:
            pool.copy_slots(a, b, n)


def _graph_step(graphs: StepGraphs, r: Rig, p: Prepared, nxt: Prepared | None
                ) -> Pending | None:
    """Step p (which has a graph key) through its CUDA graph (`gpu_backend.device.graphs`), or None:
    run it eagerly. With the incremental watch the graph applies the block events and the
    checks; otherwise they run here around it."""
    watch = r.watch
    if graphs.checks:
        got = graphs.run(p)
        if got is None:
            return None
        assert isinstance(watch, IncrementalWatch)
        watch.after_graph(p, nxt is None)
        if isinstance(got, ArenaResults):  # its results in the loop's arena
            return Pending(p, got, got)
        tok, moved = got
        assert moved is not None
        return Pending(p, tok, moved)
    _apply_events(r.pool, p)
    watch.after_events(p)
    got = graphs.run(p)
    if got is None:
        return _one_step(lambda: r, graphs.truth, graphs.k, p, {}, graphs.hq)(nxt)
    assert not isinstance(got, ArenaResults)  # an arena only with the incremental watch
    return Pending(p, got[0], watch.after_kernels(p, nxt, nxt is None))


def _eager_step(rig: Callable[[], Rig], truth: TruthStore, kernels: Kernels, p: Prepared,
                skip: dict[int, str], hq: int) -> Callable[[Prepared | None], Pending]:
    """The step's block events, the watch around them, then its kernels, launch by launch.
    Returns what finishes it once the next step is known (the watch checks that step's touched
    pages ahead). A deferred step (`prepare.complete`) queues its content and reference first,
    then completes its preparation while the device runs them: they read the truth, which
    nothing else here touches; the rig is made there, if it is not yet (`Rig`)."""
    def events() -> None:
        r = rig()
        complete(p)
        r.watch.before_events(p)
        _apply_events(r.pool, p)
        r.watch.after_events(p)

    if p.deferred is not None:
        return _one_step(rig, truth, kernels, p, skip, hq, events)
    events()
    return _one_step(rig, truth, kernels, p, skip, hq)


def _one_step(rig: Callable[[], Rig], truth: TruthStore, kernels: Kernels, p: Prepared,
              skip: dict[int, str], hq: int, events: Callable[[], None] | None = None
              ) -> Callable[[Prepared | None], Pending]:
    """The step's content, kernels and reference; `events`, if any, run between the content's
    and reference's launches and the kernels'. With a stream for the reference
    (`TruthStore.side`) it is queued there before the kernels and runs beside them."""
    kv, q, tq = _content(truth, p, hq)
    ref = None
    if events is not None or truth.side is not None:
        # its output from the current stream's memory: the side stream allocates nothing large
        # (a prompts' step's is 0.5 GB at 64 x 2k), which its own cache would hold apart
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device) \
            if truth.side is not None else None
        with beside(truth.side):
            ref = reference(truth, p.dv, p.groups, q if tq is None else tq, out)
    if events is not None:
        events()
    b, r = p.b, rig()
    watch = r.watch
    try:
        if b.step in skip:
            watch.on_fault()
            return lambda nxt: Pending(p, None, None, skip[b.step])
        out = kernels.run_step(r.pool, b, p.rows, p.dv, kv[0], kv[1], q)
    except KernelFault as e:
        watch.on_fault()
        msg = str(e)
        return lambda nxt: Pending(p, None, None, msg)
    finally:  # before anything after the step reads what the reference reads or writes
        join(truth.side)
    if ref is None:
        ref = reference(truth, p.dv, p.groups, q if tq is None else tq)
    tok = token_errors(out, ref)
    return lambda nxt: Pending(p, tok, watch.after_kernels(p, nxt, nxt is None))


def _content(truth: TruthStore, p: Prepared, hq: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Engine K/V [2, nnz_a, H_kv, D] of every append and Q [nnz_q, Hq, D] of every query at
    the engine's RoPE positions, and the truth (K/V written into the store; Q returned when it
    differs from the engine's). Usually one content launch does all of it."""
    dv = p.dv  # the store is [2, slots, H_kv, span, D] in the pool's dtype
    dt, hkv, d = truth.kv.dtype, int(truth.kv.shape[2]), int(truth.kv.shape[4])
    if p.fill:  # new requests' prefixes, at their true positions 0..committed-1
        content_kv_q(dv.fill_tok_m_f64, dv.fill_pos_m_f64, hkv, hq, d, dt, False,
                     truth=(truth.kv, dv["fill_slot"], dv["fill_pos"]))
    # the engine's positions are the truth's and the queries are the appends: one pass
    direct = p.truth_same and p.q_identity
    tw = (truth.kv, dv["tslot"], dv["true_pos"])
    kv, q = content_kv_q(dv.app_tok_m_f64, dv.app_pos_m_f64, hkv, hq, d, dt,
                         nan=dv.eng_nan_mask if p.engine_nan else None,
                         truth=tw if direct else None)
    assert q is not None
    if not p.q_identity:
        q = q[dv["q2a"]]
    if direct:
        return kv, q, None
    if p.truth_same:
        truth.write(dv["tslot"], dv["true_pos"], kv[:, dv["q2a"]])
        return kv, q, None
    _, tq = content_kv_q(dv.tok_m_f64, dv.true_pos_m_f64, hkv, hq, d, dt, truth=tw)
    return kv, q, tq

BANK_WORDS = 1 << 25  # int64 words of the banked steps' chunks, at most (256 MiB pinned, as
# much on the device), besides the bank's steps (`loop.BANK`)


class ReadySteps:
    """The prepared steps in order, some pulled ahead of the loop (at most `bank`) while the
    host would otherwise wait for the device (`fill`)."""

    def __init__(self, steps: Iterator[Prepared], bank: int):
        self.steps, self.bank = steps, bank
        self.banked: deque[Prepared] = deque()
        self.pulled = 0  # steps prepared ahead in all
        self.words = 0  # of the chunks that banked steps came in since the bank was last empty
        self.chunk: object = None

    def next(self) -> Prepared | None:
        if not self.banked:
            self.words = 0
            return next(self.steps, None)
        return self.banked.popleft()

    def fill(self, busy: torch.cuda.Event | None) -> None:
        """Prepare steps until the device has done the work before `busy` (None: no device
        work to wait for) or the bank is full. Past the event by one step's preparation at
        most."""
        while busy is not None and len(self.banked) < self.bank and \
                self.words < BANK_WORDS and not busy.query():
            p = next(self.steps, None)
            if p is None:
                return
            self.banked.append(p)
            self.pulled += 1
            if p.dv.chunk is not self.chunk:
                self.chunk, self.words = p.dv.chunk, self.words + p.dv.chunk.n
