"""A steady MTP step's preparation past its layout and truth slots in one compiled pass: its
content inputs, the reference's group, and the CUDA graph's block (`graph_block.block`) with the
arrays staged beside it.

Why: at batch 64 x kv 2k that part of a generation step (`prepare._first` past the slots, and
`_rest`: FlashInfer's seq_lens, the launch's qo_indptr, the pages the appends target, FA2's
plan, the block's padded fields, then ~20 staged arrays) took ~170 µs of a ~380 µs
preparation on a development machine, in ~70 numpy calls and `Chunk.add`s of a few µs each.
Here the block is one int64 array written field by field and staged with one `Chunk.add`: the
same words at the same offsets, the same views (`staged`). `prepare`'s own way stays as the
oracle (tests/unit/test_steady_block.py holds every step of the replay test traces to its words,
views and groups).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

import numpy as np

from gpu_backend.device.pool import M
from gpu_backend.host import graph_block, prepare_jit
from gpu_backend.host.batch import RefGroup, StepBatch, stale_plan
from gpu_backend.host.layout import TAIL
from gpu_backend.host.layout_jit import flatten, one_width
from gpu_backend.host.staging import ALIGN, Chunk, Lazy, Slot, StepArrays
from sim.jit_cache import drop_stale

drop_stale(__file__)

import numba as nb  # noqa: E402

_NONE = np.zeros(0, dtype=np.int64)


def steady(b: StepBatch) -> bool:
    """Whether step b has the steady MTP step's shape that `packed` takes (it checks the rest):
    FA2, one verify launch over every row, its queries its appends, planned for itself, short
    enough for the compiled passes. `prepare` checks it before it has a batch (`may`, then
    in its compiled call); tests/unit/test_steady_batch.py holds every step it packs to this."""
    runs = b.runs
    return (b.backend == "fa2" and len(runs) == 1 and runs[0][2] == "verify"
            and b.num_tokens == len(b.app_tokens) and prepare_jit.takes(len(b.engine_write))
            and stale_plan(b, 0, b.num_rows, "verify") is None)


def packed(caps: dict[tuple[int, int], Any], b: StepBatch, slots: np.ndarray,
           arrays: dict[str, np.ndarray], ops: list[Any], touched: np.ndarray, prev: int,
           planner: graph_block.Planner, pages: int, rope_rows: int | None, chunk: Chunk
           ) -> tuple[Any, StepArrays, tuple[Any, ...], RefGroup] | None:
    """Stage `steady` step b as a graph step in `chunk`: (its graph key, its arrays, (wpages,
    wcheck, wok), the reference's one group), as `prepare._first` and `_rest` stage them, or
    None (nothing staged, `caps` untouched): not a graph step (`prepare` then takes it its own
    way). `slots`: its rows' truth slots (`truth.admit`, no prefix to fill); `arrays`:
    its events' poisoned rows; `touched`: the pages the events touched (not distinct);
    `pages`: the pool's (the watch's targets lie below it); `prev`: the step prepared before."""
    R = len(slots)
    if not fits(R, arrays, ops, touched):
        return None
    W = int(b.q_len[0])
    plan = _plan_args(planner, R, W)
    prows = rows_of(arrays, ops)
    have = caps.get((R, W), (R, W, 0, 0, 0, 0, 0))
    n = len(b.app_tokens)
    args = (b.app_tokens, b.app_rope, b.rope_pos, b.true_pos, b.committed, slots, b.app_row,
            b.append_pos, b.qo_indptr, b.kv_indptr, b.last_page_len, b.kv_indices, prows,
            touched, b.engine_write, b.write_ok, b.allowed_pages, b.q_len,
            params(pages, b.step, prev, b.page_size, have, rope_rows), plan)
    start = chunk.n
    # the block written where the chunk stages it (`Chunk.claim`)
    at, room = chunk.claim(_most(len(b.kv_indices), int(plan[0]), n, R, have, len(touched),
                                 len(prows)))
    got = _steady(*args, room)
    if not got[0] or got[0] > len(room):  # not a graph step (or a bound too low: not written)
        chunk.trim(start)
        if not got[0]:
            return None
        at, room = chunk.claim(got[0])
        got = _steady(*args, room)
    return finish(caps, chunk, at, R, W, int(plan[0]), slots, arrays, ops, got)


def fits(R: int, arrays: dict[str, np.ndarray], ops: list[Any], touched: np.ndarray) -> bool:
    """Whether a step's rows and events fit `packed`: rows, its events' pages few enough for
    the compiled passes, its events all poison (no copies)."""
    return bool(R and prepare_jit.takes(len(touched)) and len(arrays) == len(ops)
                and all(op[0] == "nan" for op in ops))


def rows_of(arrays: dict[str, np.ndarray], ops: list[Any]) -> np.ndarray:
    """The events' poisoned pool rows end to end, in the ops' order (the block's gr_prows)."""
    return arrays[f"ev{ops[0][1]}"] if len(ops) == 1 else \
        np.concatenate([arrays[f"ev{op[1]}"] for op in ops]) if ops else _NONE


def params(pages: int, step: int, prev: int, page_size: int, have: Any,
           rope_rows: int | None) -> np.ndarray:
    """`_steady`'s step argument: the pool's pages, the step, the step before, the page size,
    the key's capacities so far, the RoPE table's rows (-1: none), M."""
    return np.array((pages, step, prev, page_size, *have[2:6],
                     -1 if rope_rows is None else rope_rows, M), np.int64)


def finish(caps: dict[tuple[int, int], Any], chunk: Chunk, at: int, R: int, W: int,
           words: int, slots: np.ndarray, arrays: dict[str, np.ndarray], ops: list[Any],
           got: tuple[Any, ...]) -> tuple[Any, StepArrays, tuple[Any, ...], RefGroup]:
    """`packed`'s result from what `_steady` wrote at `at` (`got`: its outputs): the chunk
    ends after its seq_lens, the key's capacities grow, the views are made on first look."""
    size, cap, nset, wpages, wcheck, wok, top, consecutive, low = got
    seq = _seq_at(size)
    chunk.trim(at + seq + R)
    key = caps[(R, W)] = (R, W, *cap, words)
    group = _group(R, W, top, int(slots[0]) if consecutive else -1, low)
    views = partial(_slots, key, at, size, seq, R, arrays, ops, nset, len(wpages))
    return key, Lazy(chunk, views, ((size,), (1,), at)), (wpages, wcheck, wok), group


def _seq_at(size: int) -> int:
    """Where a block of `size` words puts seq_lens: the next aligned word (`Chunk.add`)."""
    return size + (-size % ALIGN)


def _group(R: int, W: int, top: int, s0: int, low: int) -> RefGroup:
    """RefGroup("g0_", R, W, top, s0, low, True, (0, R * W)) without the frozen dataclass's
    __init__ (~4 µs a step; as `layout.build_step` makes a StepBatch)."""
    g = object.__new__(RefGroup)
    g.__dict__.update(pre="g0_", R=R, W=W, L=top, s0=s0, lo=low, identity=True,
                      span=(0, R * W), ragged=False)
    return g


def _most(pages: int, plan: int, n: int, R: int, have: Any, touched: int, prows: int) -> int:
    """The most words the block of a step and its seq_lens can take (`_pack`'s sizes, each
    field padded): its distinct touched pages are at most `touched`, its target pages at most
    its `n` appends."""
    return (pages + plan + 7 * n + 5 * R + 8 + 18 * ALIGN
            + max(have[3], graph_block._cap(touched, 4 * R))
            + max(have[4], graph_block._cap(n, 4 * R))
            + max(have[5], graph_block._cap(prows, 16 * R)))


def _slots(key: Any, at: int, size: int, seq: int, R: int, arrays: dict[str, np.ndarray],
           ops: list[Any], touched: int, wpages: int) -> dict[str, Slot]:
    """The slots of a step `packed` wrote at `at` (the block of `size` words, seq_lens of R
    at `seq` past it), as `stage_graph` makes them: its fields' where `stage` would have put
    each field's array, then the events' rows (`arrays`' order), seq_lens, the distinct
    touched pages and the target pages (when there are any: `rest_slots`' views), and the
    block itself as `gblk`."""
    *fields, (name, off) = _fields(key)
    slots: dict[str, Slot] = {n: (shape, strides, at + o) for n, shape, strides, o in fields}
    slots[name] = ((size - off,), (1,), at + off)
    base = _field_at(key)
    ev = _event_rows(arrays, ops, at + base["gr_prows"])
    for k, a in arrays.items():
        slots[k] = ((len(a),), (1,), ev[k])
    slots["seq_lens"] = ((R,), (1,), at + seq)
    if touched:
        slots["touched"] = ((touched,), (1,), at + base["gr_touched"])
    if wpages:
        slots["wpages"] = ((wpages,), (1,), at + base["gr_wpages"])
    slots["gblk"] = ((size,), (1,), at)
    return slots


def stage_graph(chunk: Chunk, arrays: dict[str, np.ndarray], ops: list[Any]) -> StepArrays:
    """`stage` of a graph step's arrays as `graph_block.block` ordered them (the block's fields
    first), the rest as `rest_slots` stages them: `prepare`'s own way, `staged`'s oracle."""
    items = iter(arrays.items())
    # the fields first: zip stops at the last field without taking the next array
    slots = {n: chunk.add(a) for _, (n, a) in zip(graph_block._FIELDS, items, strict=False)}
    return StepArrays(chunk, slots | rest_slots(chunk, dict(items), ops,
                                                lambda f: slots[f][2]))


# arrays of a graph step that its block holds too (padded): `rest_slots` views them there
_IN_BLOCK = {"touched": "gr_touched", "wpages": "gr_wpages"}


def rest_slots(chunk: Chunk, rest: dict[str, np.ndarray], ops: list[Any],
               field_at: Callable[[str], int]) -> dict[str, Slot]:
    """The slots of a graph step's arrays past its block's fields, in `rest`'s order. Its
    events' poisoned rows (`ev{a}`, one after the other in `ops`' order in gr_prows), its
    distinct touched pages and its target pages are views of the block's fields, which hold
    their values: staged once (three `Chunk.add`s a step less, ~10 µs on a development machine).
    The others are staged. field_at: a field's first word in the chunk."""
    ev = _event_rows(rest, ops, field_at("gr_prows"))
    out: dict[str, Slot] = {}
    for name, a in rest.items():
        off = ev.get(name)
        if off is None and name in _IN_BLOCK:
            off = field_at(_IN_BLOCK[name])
        out[name] = chunk.add(a) if off is None else ((len(a),), (1,), off)
    return out


def _event_rows(arrays: dict[str, np.ndarray], ops: list[Any], at: int) -> dict[str, int]:
    """Each event's poisoned rows (`ev{a}`) -> its first word: one after the other from `at`
    (the block's gr_prows), in `ops`' order."""
    ev = {}
    for _, a, _, _ in ops:
        ev[f"ev{a}"] = at
        at += len(arrays[f"ev{a}"])
    return ev


@lru_cache(maxsize=64)
def _field_at(key: Any) -> dict[str, int]:
    """Graph `key`'s block: array name -> its field's first word in the block (`_fields`)."""
    return {f[0]: f[-1] for f in _fields(key)}


@lru_cache(maxsize=64)
def _fields(key: Any) -> tuple[Any, ...]:
    """Graph `key`'s block fields as (array name, shape, strides, offset), the last one
    (kv_indices, of the step's own length) as (name, offset)."""
    R, W = key[0], key[1]
    out: list[Any] = []
    for (field, name, _), (off, n) in zip(graph_block._FIELDS, graph_block.offsets(key).values(),
                                          strict=True):
        if field == "kv_indices":
            out.append((name, off))
        else:
            out.append((name, (R, W), (W, 1), off) if name == "g0_limit" else
                       (name, (n,), (1,), off))
    return tuple(out)


@lru_cache(maxsize=64)
def _plan_args(planner: graph_block.Planner, R: int, W: int) -> np.ndarray:
    """FA2's plan constants for R rows of W queries (`graph_block.image`'s arguments to `_fill`,
    the plan's int32 words first), for `_pack`; read-only."""
    lay = graph_block.layout(planner, R, W)
    a = lay.at
    out = np.array((lay.words, lay.rows, lay.width, lay.tiles_q, lay.max_batch, lay.padded,
                    lay.min_chunk, lay.max_partial_rows, a["request_indices"] // 4,
                    a["qo_tile_indices"] // 4, a["kv_tile_indices"] // 4, a["o_indptr"] // 4,
                    a["kv_chunk_size"] // 4, a["total_num_rows"] // 4, a["merge_indptr"] // 4,
                    a["block_valid_mask"]), np.int64)
    out.setflags(write=False)
    return out


@nb.njit(cache=True)
def _cap(n: int, floor: int) -> int:
    """`graph_block._cap`: the power of two at or above max(n, floor, 1)."""
    m, c = max(n, floor, 1), 1
    while c < m:
        c *= 2
    return c


@nb.njit(cache=True)
def _field(block: np.ndarray, at: int, a: np.ndarray) -> None:
    """a's values from block[at], widened to int64 as `Chunk.add` stages them."""
    for i in range(len(a)):
        block[at + i] = a[i]


@nb.njit(cache=True)
def _steady(tokens, app_rope, rope_pos, true_pos, committed, slots, app_row, append_pos, qo,
            kv_indptr, last_page_len, kv_indices, prows, touched, ew, write_ok, allowed, q_len,
            step, plan_args, room):  # pragma: no cover  (compiled; its oracle is `prepare`'s)
    """The step's content inputs (`prepare_jit.content`), the reference's identity group
    (`prepare_jit.identity_group`), then `_pack`: its outputs, then the group's (top, consecutive,
    low). Not a graph step (a block of 0 words): the engine's RoPE positions are not the
    truth's, or one is past the RoPE table. step: `_pack`'s, then the RoPE table's rows (-1:
    none) and M; room: where `_pack` writes the block."""
    tok_m, pos_m, top, same = prepare_jit.content(tokens, app_rope, rope_pos, true_pos, step[9])
    W = q_len[0]
    limit, consecutive, gtop, low = prepare_jit.identity_group(committed, slots, W)
    if not same or (step[8] >= 0 and top >= step[8]):
        none = np.zeros(0, np.int64)
        return 0, (0, 0, 0, 0), 0, none, 0, np.zeros(0, np.bool_), gtop, consecutive, low
    tslot = np.empty(len(slots) * W, np.int64)
    for r in range(len(slots)):
        for j in range(W):
            tslot[r * W + j] = slots[r]
    size, cap, nset, wpages, wcheck, wok = _pack(
        tok_m, pos_m, tslot, true_pos, app_row, append_pos, qo, kv_indptr, last_page_len,
        slots, limit, kv_indices, prows, touched, ew, write_ok, allowed, q_len, step, plan_args,
        room)
    return size, cap, nset, wpages, wcheck, wok, gtop, consecutive, low


@nb.njit(cache=True)
def _pack(tok_m, pos_m, tslot, true_pos, app_row, append_pos, qo, kv_indptr, last_page_len,
          g0_slots, g0_limit, kv_indices, prows, touched, ew, write_ok, allowed, q_len, step,
          plan_args, room):  # pragma: no cover  (compiled; its oracle is `prepare._rest`'s)
    """The block of `graph_block.offsets`' layout, written into room[:size], then FlashInfer's
    seq_lens at the next aligned word (where `rest_slots` stages it), and what `_rest` stages
    beside them: (size (0: not a graph step; past len(room): nothing written, the words it
    needs), the capacities (kv_indices, touched, targets, rows), how many distinct touched
    pages, wpages, wcheck, wok). step: [pages in the pool, step, previous step, page size, the key's
    capacities so far (4)]; plan_args: `_plan_args`."""
    pages, page_size = step[0], step[3]
    words = plan_args[0]
    none = np.zeros(0, np.int64)
    R = len(last_page_len)
    W = q_len[0]
    for r in range(R):
        if q_len[r] != W:
            return 0, (0, 0, 0, 0), 0, none, 0, np.zeros(0, np.bool_)
    plan = np.zeros(words, np.int32)
    pa = plan_args
    if not graph_block._fill(kv_indptr, pa[1], pa[2], pa[3], pa[4], pa[5], pa[6], pa[7], page_size,
                         pa[8], pa[9], pa[10], pa[11], pa[12], pa[13], pa[14], pa[15], plan):
        return 0, (0, 0, 0, 0), 0, none, 0, np.zeros(0, np.bool_)
    tset = prepare_jit.distinct(touched) if len(touched) else none
    wpages, wcheck, wok = prepare_jit.targets(ew, pages, tset, len(touched) > 0, allowed, write_ok)
    # ints, not an array: each array a compiled call returns costs ~0.45 µs to box
    cap = (max(step[4], _cap(len(kv_indices), 1)), max(step[5], _cap(len(tset), 4 * R)),
           max(step[6], _cap(len(wpages), 4 * R)), max(step[7], _cap(len(prows), 16 * R)))
    seq = prepare_jit.seq_lens(kv_indptr, last_page_len, page_size)
    n = R * W
    # the fields' lengths in `graph_block._FIELDS`' order, kv_indices (last) at its own length
    sizes = (n, n, n, n, n, n, R + 1, R + 1, R, R, n, 8, cap[1], cap[2], cap[3], words,
             len(kv_indices))
    at = np.empty(len(sizes), np.int64)
    end = 0
    for i in range(len(sizes)):
        at[i] = end
        end += sizes[i] + (-sizes[i] % ALIGN)
    size = at[-1] + len(kv_indices)
    # seq_lens after the block, where `Chunk.add` would stage it next (`rest_slots`' order)
    sat = size + (-size % ALIGN)
    if sat + R > len(room):
        return sat + R, cap, len(tset), wpages, wcheck, wok
    room[size: sat] = 0
    _field(room, sat, seq)
    _write_block(room[:size], at, n, R, words, tok_m, pos_m, tslot, true_pos, app_row,
                 append_pos, qo, kv_indptr, last_page_len, g0_slots, g0_limit, tset, wpages,
                 wcheck, step, prows, plan, kv_indices)
    return size, cap, len(tset), wpages, wcheck, wok


@nb.njit(cache=True, inline="always")
def _write_block(block, at, n, R, words, tok_m, pos_m, tslot, true_pos, app_row, append_pos, qo,
                 kv_indptr, last_page_len, g0_slots, g0_limit, tset, wpages, wcheck, step, prows,
                 plan, kv_indices):  # pragma: no cover  (compiled)
    """`_pack`'s fields into the block, each at its offset `at` (`graph_block.offsets`)."""
    # past each field's values up to the next field, zeros (padding, params' last two words,
    # the capacities' unused part): the rest of the block is written once, not zeroed first
    filled = (n, n, n, n, n, n, R + 1, R + 1, R, R, n, 6, len(tset), len(wpages), len(prows),
              words)
    for i in range(len(filled)):
        block[at[i] + filled[i]: at[i + 1]] = 0
    block[at[0]: at[0] + n] = tok_m.view(np.int64)
    block[at[1]: at[1] + n] = pos_m.view(np.int64)
    _field(block, at[2], tslot)
    _field(block, at[3], true_pos)
    _field(block, at[4], app_row)
    _field(block, at[5], append_pos)
    q0 = qo[0]
    for r in range(R + 1):
        block[at[6] + r] = qo[r] - q0
    _field(block, at[7], kv_indptr)
    _field(block, at[8], last_page_len)
    _field(block, at[9], g0_slots)
    _field(block, at[10], g0_limit.ravel())
    params = (len(tset), len(wpages), wcheck, step[1], step[2], len(prows))
    for i in range(6):
        block[at[11] + i] = params[i]
    _field(block, at[12], tset)
    _field(block, at[13], wpages)
    _field(block, at[14], prows)
    _field(block, at[15], plan)
    _field(block, at[16], kv_indices)


@nb.njit(cache=True)
def steady_pass(q_len, a_len, append_pos, rope_pos, tokens, committed, alloc, alloc_len,
                lead, is_gen, new_tokens, starts, pages_len, pages, is_ctx, last_page_len,
                kv_len, shared, B, guard, slots, prows, touched, step, plan_args, room
                ):  # pragma: no cover  (compiled; its oracle is `build_step` + `steady_jit.packed`)
    """`layout_jit`'s twelve arrays (`layout._FLAT`), the int32 kv_indptr, last_page_len and
    kv_len, the rows' one width (`one_width`), then `steady_jit._steady`'s outputs when the
    step is steady (its queries its appends, one width): else a block of 0 words."""
    R = len(q_len)
    indptr = np.empty(R + 1, np.int64)  # `layout._flat_indices` (FA2: the trace's CSR)
    for r in range(R):
        indptr[r] = starts[r]
    indptr[R] = starts[R - 1] + pages_len[R - 1] if R else 0
    f = flatten(q_len, a_len, append_pos, rope_pos, tokens, committed, alloc, alloc_len, lead,
                is_gen, new_tokens, indptr, pages, shared, B, guard, TAIL)
    kv_indptr, last, kvl = indptr.astype(np.int32), last_page_len.astype(np.int32), \
        kv_len.astype(np.int32)
    w = one_width(is_ctx, q_len)
    if w > 1 and f[0][R] == len(tokens):
        got = _steady(tokens, f[6], rope_pos, f[3], committed, slots, f[5],
                                append_pos, f[0], kv_indptr, last, f[1], prows, touched, f[7],
                                f[8], f[9], q_len, step, plan_args, room)
    else:
        got = (0, (0, 0, 0, 0), 0, np.zeros(0, np.int64), 0, np.zeros(0, np.bool_), 0, False,
               0)
    return (f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11],
            kv_indptr, last, kvl, w, got[0], got[1], got[2], got[3], got[4], got[5], got[6],
            got[7], got[8])
