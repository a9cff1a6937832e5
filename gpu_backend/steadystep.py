"""A steady MTP step from its trace columns in one compiled call: its layout
(`flatten.flatten`, what `layout.build_step` makes) and its CUDA graph's block
(`blockpack._steady`) together.

Why: `build_step` then `blockpack.packed` were two compiled calls with ~25 µs of Python
between and around them on a development machine (the engine's flat table, three int32
copies, the launch run, the steadiness checks, ~20 of the batch's arrays unboxed again for
the second call), ~3x that on the H200's host, where a 64 x 2k generation step's preparation
is most of the replay's host time. The batch and the block are the ones the two calls make:
tests/unit/test_blockpack.py holds every step of the replay test traces to the words, views,
keys and host state of `prepare`'s general way, and test_steadystep.py each batch to
`build_step`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_backend import blockpack, fa2plan, prepk
from gpu_backend.layout import TAIL, _no_xqa, width_runs
from gpu_backend.staging import Chunk
from gpu_backend.stepbatch import I32, Columns, StepBatch, assemble
from sim.jit_cache import drop_stale
from sim.trace.records import StepRecord

drop_stale(__file__)

import numba as nb  # noqa: E402

from gpu_backend.flatten import flatten, one_width  # noqa: E402


def may(s: StepRecord, c: Columns | None, checked: bool) -> bool:
    """Whether step s may be a steady MTP step (`blockpack.steady`, as far as its record and
    columns tell before the compiled call, which checks the rest): FA2, checked columns, rows
    of one query width over 1, appends few enough for the compiled passes, planned for
    itself."""
    if c is None or not checked or s.backend != "fa2":
        return False
    q = c["q_len"]
    R = len(q)
    return (R > 0 and int(q[0]) > 1 and prepk.takes(len(c["append_pos"]))
            and (s.plan_q_len < 0 or (s.plan_batch == R and s.plan_q_len == int(q[0]))))


def take(caps: dict[tuple[int, int], Any], s: StepRecord, c: Columns, shared: np.ndarray,
         page_size: int, guard: int, slots: np.ndarray, arrays: dict[str, np.ndarray],
         ops: list[Any], touched: np.ndarray, prev: int, planner: fa2plan.Planner, pages: int,
         rope_rows: int | None, chunk: Chunk) -> tuple[StepBatch, tuple[Any, ...] | None] | None:
    """Step s (`may`) laid out and staged as a graph step in `chunk`: (its batch, what
    `blockpack.packed` returns for it); (its batch, None): not a graph step (nothing staged);
    None: its events do not fit the pass (`blockpack.fits`: `build_step` makes its batch).
    The other arguments are `packed`'s."""
    R = len(slots)
    if not blockpack.fits(R, arrays, ops, touched):
        return None
    W = int(c["q_len"][0])
    plan = blockpack._plan_args(planner, R, W)
    prows = blockpack.rows_of(arrays, ops)
    have = caps.get((R, W), (R, W, 0, 0, 0, 0, 0))
    start = chunk.n
    at, room = chunk.claim(blockpack._most(len(c["pages"]) + TAIL, int(plan[0]),
                                           len(c["append_pos"]), R, have, len(touched),
                                           len(prows)))
    out = _fused(c["q_len"], c["append_pos_len"], c["append_pos"], c["rope_pos"], c["tokens"],
                 c["committed"], c["alloc"], c["alloc_len"], c["shared_blocks"], c["is_gen"],
                 c["new_tokens"], c["kv_indptr"], c["pages_len"], c["pages"], c["is_ctx"],
                 c["last_page_len"], c["kv_len"],
                 np.sort(shared) if len(shared) > 1 else shared, page_size, guard, slots,
                 prows, touched, blockpack.params(pages, s.step, prev, page_size, have,
                                                  rope_rows), plan, room)
    flat, (kv_indptr, last, kv_len), w, got = out[:12], out[12:15], out[15], out[16:]
    b = assemble(s, page_size, guard, c, flat, kv_indptr, last, kv_len,
                 np.zeros((R, 0), dtype=I32), _no_xqa(R), width_runs(w, c))
    if got[0] and got[0] <= len(room):
        return b, blockpack.finish(caps, chunk, at, R, W, int(plan[0]), slots, arrays, ops, got)
    chunk.trim(start)
    if not got[0]:  # not steady after all, or not a graph step
        return b, None
    # room too small for the bound (it is not): `packed` claims what the pass said it needs
    return b, blockpack.packed(caps, b, slots, arrays, ops, touched, prev, planner, pages,
                               rope_rows, chunk)


@nb.njit(cache=True)
def _fused(q_len, a_len, append_pos, rope_pos, tokens, committed, alloc, alloc_len, lead,
           is_gen, new_tokens, starts, pages_len, pages, is_ctx, last_page_len, kv_len, shared,
           B, guard, slots, prows, touched, step, plan_args, room
           ):  # pragma: no cover  (compiled; its oracle is `build_step` + `blockpack.packed`)
    """`flatten`'s twelve arrays (`layout._FLAT`), the int32 kv_indptr, last_page_len and
    kv_len, the rows' one width (`one_width`), then `blockpack._steady`'s outputs when the
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
        got = blockpack._steady(tokens, f[6], rope_pos, f[3], committed, slots, f[5],
                                append_pos, f[0], kv_indptr, last, f[1], prows, touched, f[7],
                                f[8], f[9], q_len, step, plan_args, room)
    else:
        got = (0, (0, 0, 0, 0), 0, np.zeros(0, np.int64), 0, np.zeros(0, np.bool_), 0, False,
               0)
    return (f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10], f[11],
            kv_indptr, last, kvl, w, got[0], got[1], got[2], got[3], got[4], got[5], got[6],
            got[7], got[8])
