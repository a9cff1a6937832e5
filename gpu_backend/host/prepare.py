"""Everything the replay needs that depends on the trace alone, built on the host ahead of the
device work (pure numpy) and staged in chunks of steps, one pinned upload each:

- the block events of each step as pool operations (poison runs, copies), the in-flight frees;
- the flat kernel inputs (`layout.build_step`, with the shared blocks from the events' refcounts);
- the truth store's slots (admission, release) and prefix fills, and the content inputs (token
  and position mod M as float64, the RoPE-overrun NaN mask): `truth`;
- the fp32 reference's index arrays (`batch.RefGroup`), the rewind's pool rows;
- a steady MTP step's layout and graph block in one compiled call (`prepare`, `steady_jit`).

The step loop (`loop.replay`) then only launches device work: no numpy, no host-device syncs.

A steady MTP step from its trace columns in one compiled call: its layout
(`layout_jit.flatten`, what `layout.build_step` makes) and its CUDA graph's block
(`steady_jit._steady`) together.

Why: `build_step` then `steady_jit.packed` were two compiled calls with ~25 µs of Python
between and around them on a development machine (the engine's flat table, three int32
copies, the launch run, the steadiness checks, ~20 of the batch's arrays unboxed again for
the second call), ~3x that on the H200's host, where a 64 x 2k generation step's preparation
is most of the replay's host time. The batch and the block are the ones the two calls make:
tests/unit/test_steady_block.py holds every step of the replay test traces to the words, views,
keys and host state of `prepare`'s general way, and test_steady_batch.py each batch to
`build_step`'s.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from gpu_backend.host import events, graph_block, prepare_jit, steady_jit, truth
from gpu_backend.host.batch import I32, Columns, PoolOp, RefGroup, StepBatch, assemble
from gpu_backend.host.events import InFlight, in_flight_poison
from gpu_backend.host.graph_block import Key as GraphKey
from gpu_backend.host.graph_block import Planner
from gpu_backend.host.layout import (
    TAIL,
    _no_xqa,
    build_step,
    kernel_arrays,
    prompts_batch,
    run_arrays,
    token_rows,
    width_runs,
)
from gpu_backend.host.staging import Chunk, FromRows, Joined, StepArrays, ramp, stage, words_ahead
from gpu_backend.host.steady_jit import steady_pass
from gpu_backend.host.truth import distinct, ref_groups, targets
from gpu_backend.trace import TraceData
from sim.trace.records import RowRecord, StepRecord

CHUNK_WORDS = 1 << 22  # int64 words per upload (32 MiB pinned): bounds host memory on long traces
# ... or steps, whichever comes first. The next chunk is prepared a step at a time between the
# steps of the one before (`prepared_steps`) instead of stalling the device for its whole
# preparation. While preparing a step takes the host longer than the device's step (every size
# measured so far) that only hides the device's share: a wash end to end on the H200;
# it pays once preparation is faster than the device
CHUNK_STEPS = 8


@dataclass
class Prepared:
    step: StepRecord
    rows: list[RowRecord]
    b: StepBatch
    dv: StepArrays
    ops: list[PoolOp]  # the last step's rewind, then the block events (`events`)
    touched: bool  # pages changed since the last step's checksum: re-sum `touched`
    fill: bool  # new requests' prefixes go into the truth store (fill_*)
    engine_nan: bool  # some engine K/Q is past the RoPE table (eng_nan)
    truth_same: bool  # truth K/V/Q of the queries == the engine's (one content pass)
    q_identity: bool  # the queries are the appends (no device-ahead extras)
    groups: list[RefGroup]
    # pool indices the engine's appends target, distinct: the first `wcheck` are not among the
    # pages this step's events touch (`watch.IncrementalWatch` checks those against their
    # expected sums; the others were just re-summed)
    wpages: np.ndarray
    wcheck: int
    # per page of wpages: the truth lets this step write it, through every append that does
    # (a checksum that moves there blames nobody: `verdicts._verdicts` skips the blame)
    wok: np.ndarray
    graph: GraphKey | None = None  # its CUDA graph's key (`graph_block.block`), if any
    # what stages the rest of its arrays (`complete`), if `prepare_step` deferred it
    deferred: Callable[[Prepared], None] | None = None


@dataclass
class HostState:
    """The host bookkeeping the old loop kept between steps: shared blocks and truth slots."""
    trace: TraceData
    guard: int
    rope_rows: int | None
    # blocks whose refcount is > 1 (the refcounts themselves are not kept: nothing reads them,
    # and a 128 x 8k prompts' step's 65k went into a dict for ~2 ms)
    shared: set[int] = field(default_factory=set)
    slot: dict[int, int] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    last: dict[int, int] = field(default_factory=dict)
    ends: dict[int, set[int]] | None = None  # step -> the requests `last` ends there
    # the last admitted step's requests and their slots: a step of the same requests has
    # them all live (none ended: each was in this step), so the same slots (`truth.admit`)
    held: tuple[bytes, np.ndarray] | None = None
    seconds: float = 0.0
    step_seconds: dict[int, float] = field(default_factory=dict)  # step -> its `prepare_step` time
    # the last prepared step's rewind (pool rows, pages): applied before the next step's events
    rewind: tuple[np.ndarray, np.ndarray] | None = None
    # lay out the steady steps' inputs for `graphs.StepGraphs`, FA2 planned for this device and
    # shape (None: no graphs)
    graphs: Planner | None = None
    graph_caps: dict[tuple[int, int], GraphKey] = field(default_factory=dict)
    prev_step: int = -1  # the step prepared last
    # a step's context rows in one reference group (`truth.ref_groups`, `reference.together`)
    together: bool = False


def prepared_steps(trace: TraceData, state: HostState, device: torch.device | str,
                   defer: bool = False) -> Generator[Prepared, None, None]:
    """The trace's steps with rows, prepared and staged a chunk at a time, one chunk ahead: once
    a chunk is staged, every step handed out follows the preparation of one step of the next
    chunk; the first chunks are small (`ramp`). The host's preparation is spread between the
    steps the device runs, instead of stalling it a whole chunk at a time.
    defer: the first step only as far as its content and reference need (`complete` stages the
    rest): the replay loop's, which queues those before completing it."""
    flight = in_flight_poison(trace)
    chunk, batch = Chunk(device), []
    ready: deque[Prepared] = deque()
    for i, s in enumerate(replayed(trace)):
        t0 = time.perf_counter()
        batch.append(prepare_step(state, s, trace.rows[s.step], flight, chunk,
                                  defer and i == 0))
        state.step_seconds[s.step] = time.perf_counter() - t0
        c = ramp(i + 1, CHUNK_STEPS, 1)
        if chunk.n >= CHUNK_WORDS or c != ramp(i, CHUNK_STEPS, 1):
            chunk.upload()
            ready.extend(batch)
            chunk = Chunk(device, words_ahead(chunk.n, len(batch), i, c, CHUNK_STEPS,
                                              CHUNK_WORDS))
            batch = []
        state.seconds += time.perf_counter() - t0
        if ready:
            yield ready.popleft()
    if batch:
        t0 = time.perf_counter()
        chunk.upload()
        ready.extend(batch)
        state.seconds += time.perf_counter() - t0
    yield from ready


def replayed(trace: TraceData) -> list[StepRecord]:
    """The steps a replay runs: those with rows (as the old loop: a step without rows has its
    events left unapplied)."""
    return [s for s in trace.steps if trace.rows[s.step]]


def prepare_step(st: HostState, s: StepRecord, rows: list[RowRecord], flight: InFlight,
                 chunk: Chunk, defer: bool = False) -> Prepared:
    """Step s's host work and its arrays, staged in `chunk`. defer: stage only what the
    content and the reference read, and leave the rest to `complete` (no CUDA graph step); a
    prompts' step then waits for none of its pages (`layout.prompts_batch`)."""
    if defer and s.step in st.trace.checked and s.step in st.trace.columns:
        thin = prompts_batch(s, st.trace.columns[s.step], st.trace.model.page_size, st.guard,
                             per_token=False)
        if thin is not None:
            return _content_first(st, s, rows, flight, chunk, thin)
    arrays: dict[str, np.ndarray] = {}
    ops, touched = events.step_ops(st, s, flight, arrays)
    first: dict[str, np.ndarray] = {}  # what the content and the reference read
    cols = st.trace.columns.get(s.step)
    if not defer and st.graphs is not None and \
            may(s, cols, s.step in st.trace.checked):
        assert cols is not None
        slots, fill = truth.admit_rows(st, cols["request"], cols["committed"], first)
        got = None if fill else _steady(st, s, rows, cols, slots, arrays, ops, touched, chunk)
        if isinstance(got, Prepared):
            return got
        b = got if got is not None else _batch(st, s, rows)
        eng_nan, same, groups = _content_reference(st, b, slots, first)
    else:
        b = _batch(st, s, rows)
        fill, eng_nan, same, groups = _first(st, b, first)
    q_identity = b.num_tokens == len(b.app_tokens)
    ok = not fill and not eng_nan and same and q_identity  # a CUDA graph could replay it
    prev = _advance(st, b)
    if not defer or (st.graphs is not None and graph_block.candidate(b, ok, groups)):
        arrays |= first  # staged with the rest, in one go
        first = {}
    p = Prepared(s, rows, b, stage(chunk, first), ops, False, fill, eng_nan, same, q_identity,
                 groups, _NONE, 0, _NONE)
    if first:
        p.deferred = partial(_deferred, st, touched, arrays, prev, Chunk(chunk.dev))
    else:
        _rest(st, touched, arrays, prev, ok, chunk, p)
    return p


_NONE = np.zeros(0, dtype=np.int64)


def _batch(st: HostState, s: StepRecord, rows: list[RowRecord]) -> StepBatch:
    shared = np.fromiter(st.shared, np.int64, len(st.shared))
    return build_step(s, rows, st.trace.model.page_size, st.guard, shared,
                      st.trace.columns.get(s.step), checked=s.step in st.trace.checked)


def _first(st: HostState, b: StepBatch, first: dict[str, np.ndarray]
           ) -> tuple[bool, bool, bool, list[RefGroup]]:
    """The truth slots of b's rows, and what the content and the reference read, into `first`.
    Returns (prefixes to fill, engine NaN, truth == engine content, the reference's groups)."""
    slots, fill = truth.admit(st, b, first)
    return (fill, *_content_reference(st, b, slots, first))


def _content_reference(st: HostState, b: StepBatch, slots: np.ndarray,
                       first: dict[str, np.ndarray]) -> tuple[bool, bool, list[RefGroup]]:
    """`_first` past the truth's slots: (engine NaN, truth == engine content, groups)."""
    eng_nan, same = truth.content_arrays(st, b, first)
    groups = ref_groups(b, slots, first, together=st.together)
    # each token's row's slot: row_of_token is each row's index q_len times, and a repeat
    # is ~8x cheaper than the gather (0.05 against 0.44 ms at a 64 x 2k prompts' step)
    first |= {"tslot": np.repeat(slots, b.q_len), "true_pos": b.true_pos}
    return eng_nan, same, groups


def _advance(st: HostState, b: StepBatch) -> int:
    """Past step b: its rejected drafts for the next step, its ended requests' slots freed.
    Returns the step prepared before it."""
    prev, st.prev_step = st.prev_step, b.step
    events.rewind(st, b)
    truth.release(st, b.step, b.requests)
    return prev


def _content_first(st: HostState, s: StepRecord, rows: list[RowRecord], flight: InFlight,
                   chunk: Chunk, thin: StepBatch) -> Prepared:
    """`prepare_step(defer=True)` of a prompts' step: its content and reference from `thin`
    (`layout.prompts_batch`, without its tokens' rows), made on the device from its rows where
    they follow from them (`truth.row_content`); its events, its whole batch and the rest
    are `complete`'s (the truth's slots, taken here, are the one state they share)."""
    first: dict[str, np.ndarray] = {}
    slots, fill = truth.admit(st, thin, first)
    if truth.row_content(st, thin, slots, first):
        groups = ref_groups(thin, slots, first, together=st.together)
        dv = stage(chunk, first)
        p = Prepared(s, rows, thin, FromRows(dv.chunk, dv.slots), [], False, fill, False, True,
                     True, groups, _NONE, 0, _NONE)
    else:
        thin = token_rows(thin)
        eng_nan, same, groups = _content_reference(st, thin, slots, first)
        p = Prepared(s, rows, thin, stage(chunk, first), [], False, fill, eng_nan, same, True,
                     groups, _NONE, 0, _NONE)
    p.deferred = partial(_prompts_rest, st, flight, Chunk(chunk.dev))
    return p


def complete(p: Prepared) -> None:
    """Stage the rest of a step that `prepare_step` deferred: the kernels' arrays, the pages
    the watch checks. The loop calls it once the step's content and reference are queued: the
    prompts' step's device work starts after 0.60-0.73x of its preparation and upload on a
    development machine."""
    if p.deferred is not None:
        rest, p.deferred = p.deferred, None
        rest(p)


def _deferred(st: HostState, touched: np.ndarray, arrays: dict[str, np.ndarray], prev: int,
              chunk: Chunk, p: Prepared) -> None:
    """`complete`'s work: `_rest` in a chunk of its own, uploaded, timed as preparation. Never
    a graph step: a graph reads its content's arrays and the rest as one block, and these were
    staged apart (the loop may set `HostState.graphs` only after the step's first part:
    `loop.Rig`)."""
    t0 = time.perf_counter()
    _rest(st, touched, arrays, prev, False, chunk, p)
    _uploaded(st, chunk, p, t0)


def _prompts_rest(st: HostState, flight: InFlight, chunk: Chunk, p: Prepared) -> None:
    """`complete`'s work for `_content_first`: the step's events, its whole batch, then
    `_rest`, as `prepare_step` does them."""
    t0 = time.perf_counter()
    arrays: dict[str, np.ndarray] = {}
    p.ops, touched = events.step_ops(st, p.step, flight, arrays)
    p.b = _batch(st, p.step, p.rows)
    _rest(st, touched, arrays, _advance(st, p.b), False, chunk, p)  # no graph: `_deferred`
    _uploaded(st, chunk, p, t0)


def _uploaded(st: HostState, chunk: Chunk, p: Prepared, t0: float) -> None:
    chunk.upload()
    spent = time.perf_counter() - t0
    st.seconds += spent
    st.step_seconds[p.step.step] = st.step_seconds.get(p.step.step, 0.0) + spent


def _rest(st: HostState, touched: np.ndarray, arrays: dict[str, np.ndarray], prev: int, ok: bool,
          chunk: Chunk, p: Prepared) -> None:
    """The step's arrays past the content's and the reference's, staged in `chunk` into p:
    the kernels' inputs, the pages its events touched and its appends target, its graph."""
    b = p.b
    arrays |= kernel_arrays(b) | run_arrays(b)
    tset = distinct(touched) if len(touched) else None
    if tset is not None:
        arrays["touched"] = tset
    p.wpages, p.wcheck, p.wok = targets(b, st.trace.model.num_blocks + 2 * st.guard, tset)
    p.touched = tset is not None
    if len(p.wpages):
        arrays["wpages"] = p.wpages
    p.graph = graph_block.block(st.graph_caps, b, arrays, p.ops, p.wpages, p.wcheck, prev, ok,
                           p.groups, st.graphs) if st.graphs is not None else None
    dv = steady_jit.stage_graph(chunk, arrays, p.ops) if p.graph is not None else \
        stage(chunk, arrays)
    p.dv = Joined(p.dv, dv) if len(p.dv) else dv
    if p.graph is not None:
        graph_block.span(dv)


def _steady(st: HostState, s: StepRecord, rows: list[RowRecord], cols: Columns,
            slots: np.ndarray, arrays: dict[str, np.ndarray], ops: list[PoolOp],
            touched: np.ndarray, chunk: Chunk) -> Prepared | StepBatch | None:
    """A `prepare.may` step past its truth slots in one compiled call: its layout and, as a
    graph step, what `_first` (past the slots), `_advance` and `_rest` make of it (the same
    words and views), or its batch alone (not a graph step: nothing staged, the host state as
    it was), or None (its events do not fit the pass)."""
    assert st.graphs is not None
    shared = np.fromiter(st.shared, np.int64, len(st.shared))
    got = take(st.graph_caps, s, cols, shared, st.trace.model.page_size, st.guard,
                          slots, arrays, ops, touched, st.prev_step, st.graphs,
                          st.trace.model.num_blocks + 2 * st.guard, st.rope_rows, chunk)
    if got is None:
        return None
    b, packed = got
    if packed is None:
        return b
    key, dv, (wpages, wcheck, wok), group = packed
    _advance(st, b)
    return Prepared(s, rows, b, dv, ops, len(touched) > 0, False, False, True, True, [group],
                    wpages, wcheck, wok, key)


def may(s: StepRecord, c: Columns | None, checked: bool) -> bool:
    """Whether step s may be a steady MTP step (`steady_jit.steady`, as far as its record and
    columns tell before the compiled call, which checks the rest): FA2, checked columns, rows
    of one query width over 1, appends few enough for the compiled passes, planned for
    itself."""
    if c is None or not checked or s.backend != "fa2":
        return False
    q = c["q_len"]
    R = len(q)
    return (R > 0 and int(q[0]) > 1 and prepare_jit.takes(len(c["append_pos"]))
            and (s.plan_q_len < 0 or (s.plan_batch == R and s.plan_q_len == int(q[0]))))


def take(caps: dict[tuple[int, int], Any], s: StepRecord, c: Columns, shared: np.ndarray,
         page_size: int, guard: int, slots: np.ndarray, arrays: dict[str, np.ndarray],
         ops: list[Any], touched: np.ndarray, prev: int, planner: graph_block.Planner, pages: int,
         rope_rows: int | None, chunk: Chunk) -> tuple[StepBatch, tuple[Any, ...] | None] | None:
    """Step s (`may`) laid out and staged as a graph step in `chunk`: (its batch, what
    `steady_jit.packed` returns for it); (its batch, None): not a graph step (nothing staged);
    None: its events do not fit the pass (`steady_jit.fits`: `build_step` makes its batch).
    The other arguments are `packed`'s."""
    R = len(slots)
    if not steady_jit.fits(R, arrays, ops, touched):
        return None
    W = int(c["q_len"][0])
    plan = steady_jit._plan_args(planner, R, W)
    prows = steady_jit.rows_of(arrays, ops)
    have = caps.get((R, W), (R, W, 0, 0, 0, 0, 0))
    start = chunk.n
    at, room = chunk.claim(steady_jit._most(len(c["pages"]) + TAIL, int(plan[0]),
                                           len(c["append_pos"]), R, have, len(touched),
                                           len(prows)))
    out = steady_pass(c["q_len"], c["append_pos_len"], c["append_pos"], c["rope_pos"], c["tokens"],
                 c["committed"], c["alloc"], c["alloc_len"], c["shared_blocks"], c["is_gen"],
                 c["new_tokens"], c["kv_indptr"], c["pages_len"], c["pages"], c["is_ctx"],
                 c["last_page_len"], c["kv_len"],
                 np.sort(shared) if len(shared) > 1 else shared, page_size, guard, slots,
                 prows, touched, steady_jit.params(pages, s.step, prev, page_size, have,
                                                  rope_rows), plan, room)
    flat, (kv_indptr, last, kv_len), w, got = out[:12], out[12:15], out[15], out[16:]
    b = assemble(s, page_size, guard, c, flat, kv_indptr, last, kv_len,
                 np.zeros((R, 0), dtype=I32), _no_xqa(R), width_runs(w, c))
    if got[0] and got[0] <= len(room):
        return b, steady_jit.finish(caps, chunk, at, R, W, int(plan[0]), slots, arrays, ops, got)
    chunk.trim(start)
    if not got[0]:  # not steady after all, or not a graph step
        return b, None
    # room too small for the bound (it is not): `packed` claims what the pass said it needs
    return b, steady_jit.packed(caps, b, slots, arrays, ops, touched, prev, planner, pages,
                               rope_rows, chunk)
