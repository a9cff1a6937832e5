"""The trace's block events as pool operations, and the frees a step in flight could see.

A step's pool operations before its kernels: the block events between the last launch and
this one (`events.event_ops`; the usual generation step's in one compiled pass, `prepare_jit`) and
the last step's rewind (its rejected drafts' slots), as runs of pool rows to poison and slot
copies (`loop._apply_events`, `graphs`' block).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpu_backend.host import prepare_jit
from gpu_backend.host.batch import PoolOp, StepBatch
from gpu_backend.trace import EVENT_CODES, TraceData
from sim.trace.records import BlockEvent, StepRecord

if TYPE_CHECKING:
    from gpu_backend.host.prepare import HostState

_ALLOC, _COPY, _EVICT, _DONE = (EVENT_CODES.index(e) for e in ("alloc", "copy", "evict", "done"))
# fewer events than this take the loop: the arrays' fixed cost (~20 numpy calls) made a 64 x 2k
# generation step's preparation (~30 events) 1.15x slower
LOOP_EVENTS = 256


def event_ops(trace: TraceData, step: int, guard: int, refcount: dict[int, int] | None,
              flight: InFlight, arrays: dict[str, np.ndarray],
              shared: set[int] | None = None) -> tuple[list[PoolOp], np.ndarray]:
    """`event_ops_loop` over the trace's event columns as arrays, a Python step per slot copy
    only, where a step has LOOP_EVENTS events or more: the loop's ~0.2 µs an event was 2.3-4.3
    ms of a 64 x 2k prompts' step's preparation (16k events) on a development machine. The
    same ops, arrays, touched pages (as an array, not in order), refcounts and shared blocks
    (tests/unit/test_events.py)."""
    cols = [c for key in ((step - 1, "proc"), (step, "sched"))
            if (c := trace.event_columns.get(key)) is not None]
    if sum(len(c.seq) for c in cols) < LOOP_EVENTS:
        ops, touched_list = event_ops_loop(trace, step, guard, refcount, flight, arrays, shared)
        return ops, np.array(touched_list, dtype=np.int64)
    g = guard
    ops = []
    run: list[np.ndarray] = []  # poisoned pool indices since the last copy
    touched: list[np.ndarray] = []

    def flush() -> None:
        if any(len(r) for r in run):
            arrays[f"ev{len(ops)}"] = np.concatenate(run)
            ops.append(("nan", len(ops), 0, 0))
        run.clear()

    for c in cols:
        live = c.code != _DONE
        # no `done` among them (a prompts' step's 8k allocations): the columns themselves, not
        # six gathers of them
        every = bool(live.all())
        code, block, seq, src, ntok, count = (
            (x if every else x[live]) for x in (c.code, c.block, c.seq, c.src, c.num_tokens,
                                                c.refcount))
        _hold(refcount, shared, block, count)
        poison = (code == _ALLOC) | (code == _EVICT)
        if flight.double_free:
            poison |= np.isin(seq, np.fromiter(flight.double_free, np.int64))
        pp = np.flatnonzero(poison)
        pages = block[pp] + g
        touched.append(pages)
        lo = 0
        for i in np.flatnonzero((code == _COPY) & (src >= 0)).tolist():
            hi = int(np.searchsorted(pp, i))
            run.append(pages[lo:hi])
            flush()
            ops.append(("copy", int(block[i]) + g, int(src[i]) + g,
                        int(ntok[i]) or trace.model.page_size))
            touched.append(block[i:i + 1] + g)
            lo = hi
        run.append(pages[lo:])
    late = np.asarray(flight.before_step.get(step, ()), dtype=np.int64) + g
    run.append(late)
    touched.append(late)
    flush()
    return ops, np.concatenate(touched)


def _hold(refcount: dict[int, int] | None, shared: set[int] | None, block: np.ndarray,
          count: np.ndarray) -> None:
    """Each block's refcount after these events (its last) into `refcount` unless None, and
    `shared` (refcount > 1)."""
    if refcount is not None:
        refcount.update(zip(block.tolist(), count.tolist(), strict=True))
    if shared is None or not len(block):
        return
    if not (count > 1).any():  # a prompts' step's allocations: no sort to find the last
        if shared:
            shared.difference_update(block.tolist())
        return
    blocks, last = np.unique(block[::-1], return_index=True)
    many = count[::-1][last] > 1
    shared.update(blocks[many].tolist())
    shared.difference_update(blocks[~many].tolist())


def event_ops_loop(trace: TraceData, step: int, guard: int, refcount: dict[int, int] | None,
                   flight: InFlight, arrays: dict[str, np.ndarray],
                   shared: set[int] | None = None) -> tuple[list[PoolOp], list[int]]:
    """The block events after launch step-1 and before launch step, then the in-flight poison,
    as pool operations in order: runs of poisoned pages (array `ev{i}` in `arrays`; prepare
    turns them into pool rows) and slot copies. Returns (ops, pool indices touched); keeps
    `shared` (blocks with more than one holder) current, and `refcount` (block -> holders,
    from the events) where given: the replay reads `shared` alone, tests hold it to `refcount`.

    alloc/evict hand a block to a new owner: its old content is garbage to it, so it is poisoned.
    free keeps content (a cached block may be reused), except the frees whose `seq` is a double
    free of a live block (`in_flight_poison`); copy moves the first num_tokens slots."""
    g, pz = guard, trace.model.page_size
    ops: list[PoolOp] = []
    run: list[int] = []
    touched: list[int] = []

    def flush() -> None:
        if run:
            arrays[f"ev{len(ops)}"] = np.array(run, dtype=np.int64)
            ops.append(("nan", len(ops), 0, 0))
            run.clear()

    for key in ((step - 1, "proc"), (step, "sched")):
        for ev in trace.events.get(key, ()):
            if ev.event == "done":
                continue
            if refcount is not None:
                refcount[ev.block] = ev.refcount
            if shared is not None:
                (shared.add if ev.refcount > 1 else shared.discard)(ev.block)
            i = ev.block + g
            if ev.event in ("alloc", "evict") or ev.seq in flight.double_free:
                run.append(i)
            elif ev.event == "copy" and ev.src >= 0:
                flush()
                ops.append(("copy", i, ev.src + g, ev.num_tokens or pz))
            else:
                continue
            touched.append(i)
    for blk in flight.before_step.get(step, ()):
        run.append(blk + g)
        touched.append(blk + g)
    flush()
    return ops, touched


def _by_seq(trace: TraceData) -> list[BlockEvent]:
    """Every block event in seq order. The (step, phase) groups hold theirs in seq order, and a
    simulator's trace lists the groups in seq order too: then this is their concatenation
    (sorting 65k events by a key took ~9 ms of a 128 x 8k replay's start)."""
    groups = [evs for evs in trace.events.values() if evs]
    if all(a[-1].seq <= b[0].seq for a, b in zip(groups, groups[1:], strict=False)):
        return [e for evs in groups for e in evs]
    return sorted((e for evs in groups for e in evs), key=lambda e: e.seq)


@dataclass
class InFlight:
    """What `in_flight_poison` found: step -> engine block ids to poison before the step runs,
    and the seqs of double frees of live blocks outside any window (poisoned in order)."""
    before_step: dict[int, list[int]] = field(default_factory=dict)
    double_free: frozenset[int] = frozenset()


def in_flight_poison(trace: TraceData) -> InFlight:
    """The frees the device could see while a step is in flight (overlap, docs/trace.md).

    Step k is in flight from its launch until the host's `done` event with src == k. A `free`
    in that window of a block its request holds, by a request with a row in step k, hands the
    pages back while k may still read them: the allocator may refill them (TRT-LLM's
    TRTLLM_KV_FRESH_PAGE_FILL poisons pages as it hands them out), so the worst legal timing
    runs k after that refill. A `free` by a request that no longer holds the block (a double
    free) puts it in the free list while another request or the prefix cache still holds it: it
    is poisoned too (before the step whose window it falls in, else at its place in order).
    A trace without `done` events (hand-built) is replayed strictly in order: nothing here."""
    # one comparison over every step's codes: a step at a time took 0.28 ms of a 256-step
    # trace's replay start, before its first launch, on a development machine (now 0.03)
    codes = [c.code for c in trace.event_columns.values()]
    if not codes or not (np.concatenate(codes) == _DONE).any():
        return InFlight()
    flat = _by_seq(trace)
    holders: dict[int, list[int]] = {}
    cached: set[int] = set()
    own_free: set[int] = set()  # seqs of frees by a holder
    live_double: set[int] = set()  # seqs of double frees of a block someone else keeps
    for e in flat:
        held = holders.setdefault(e.block, [])
        if e.event == "alloc":
            held[:] = [e.request]
            cached.discard(e.block)
        elif e.event == "reuse":
            held.append(e.request)
        elif e.event == "evict":
            held.clear()
            cached.discard(e.block)
        elif e.event == "hash":
            cached.add(e.block)
        elif e.event in ("free", "rewind"):
            if e.request in held:
                held.remove(e.request)
                if e.event == "free":
                    own_free.add(e.seq)
            elif e.event == "free" and (held or e.block in cached):
                live_double.add(e.seq)
    keys = [(e.step, 0 if e.phase == "sched" else 1) for e in flat]
    out = InFlight()
    windowed: set[int] = set()
    for s in trace.steps:
        reqs = {r.request for r in trace.rows[s.step]}
        if not reqs:
            continue
        blocks: list[int] = []
        for e in flat[bisect.bisect_left(keys, (s.step, 1)):]:
            if e.event == "done" and e.src == s.step:
                break
            if e.event != "free":
                continue
            if (e.seq in own_free and e.request in reqs) or e.seq in live_double:
                blocks.append(e.block)
                windowed.add(e.seq)
        if blocks:
            out.before_step[s.step] = blocks
    out.double_free = frozenset(live_double - windowed)
    return out


def fresh_pool(ops: list[PoolOp], arrays: dict[str, np.ndarray]) -> list[PoolOp]:
    """The replay's first step without the poison that comes before any copy: the pool starts
    all NaN (`KVPool`) and nothing has written it yet, so that poison writes NaN over NaN. A
    64 x 2k prompts' step staged 263k rows of it (its new pages), and the device rewrote 0.5 GB
    (2.9 ms at 64 x 8k). The pages stay `touched`: re-summed as before."""
    while ops and ops[0][0] == "nan":
        arrays.pop(f"ev{ops[0][1]}")
        ops = ops[1:]
    return ops

_NONE = np.zeros(0, dtype=np.int64)


def step_ops(st: HostState, s: StepRecord, flight: InFlight, arrays: dict[str, np.ndarray]
            ) -> tuple[list[PoolOp], np.ndarray]:
    """The pool operations before step s's kernels and the pages they touch (`join_rewind`):
    the usual generation step's in one compiled pass (`prepare_jit`), else `event_ops`'."""
    if st.prev_step >= 0 and not flight.double_free:
        got = prepare_jit.pool_ops(st.trace, s.step, st.guard, flight.before_step.get(s.step, []),
                               st.shared, st.rewind, arrays)
        if got is not None:
            return got
    ops, touched = event_ops(st.trace, s.step, st.guard, None, flight, arrays, st.shared)
    if st.prev_step < 0:  # before `join_rewind` turns the dropped poison's pages into rows
        ops = fresh_pool(ops, arrays)
    return join_rewind(st, ops, touched, arrays)


def rewind(st: HostState, b: StepBatch) -> None:
    """The step's rejected-draft slots as pool rows, for the next step's `join_rewind`."""
    st.rewind = None
    if b.reject_page.size:
        st.rewind = prepare_jit.rewind(b.reject_page, b.reject_slot, st.trace.model.page_size)


def join_rewind(st: HostState, ops: list[PoolOp], touched: np.ndarray,
              arrays: dict[str, np.ndarray]) -> tuple[list[PoolOp], np.ndarray]:
    """The pool operations before this step's kernels, in order: the last step's rewind (its
    rejected drafts' slots become poison: nothing reads the pool in between, and that step's
    checksums were taken before it), then the block events. Poisoned pages become their pool
    rows (`KVPool.poison_rows`), and the rewind joins the first run of poisoned pages, so a step
    usually poisons in one launch. Returns (ops, pages touched)."""
    rows, rew = 2 * st.trace.model.page_size, st.rewind
    for i, (kind, a, _, _) in enumerate(ops):
        if kind == "nan":
            # the rewind's rows first in the first run, in the same pass
            lead = rew[0] if rew is not None and i == 0 else _NONE
            arrays[f"ev{a}"] = prepare_jit.pool_rows(arrays[f"ev{a}"], rows, lead)
    if rew is None:
        return ops, touched
    rej_rows, rej_pages = rew
    touched = np.concatenate([touched, rej_pages])
    if ops and ops[0][0] == "nan":  # the rewind's rows lead its first run (`prepare_jit.pool_rows`)
        return ops, touched
    arrays["ev-1"] = rej_rows
    return [("nan", -1, 0, 0), *ops], touched
