"""Steps in flight (Ownership.inflight / busy / mark_launched / mark_processing, compiled).

One entry per (step, request) of a launched step, as Ownership keeps `{request: row}` per step:
a request twice in one batch has one entry (its last row) but counts twice in `busy`, exactly
as the dict and the counter behave there. An entry is freed when its step starts processing.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from sim.check.compiled.common import cdiv, helper
from sim.check.compiled.state import G_EFREE, G_ELIVE, G_RBASE


@helper
def reach_len(rows, r, B):  # type: ignore[no-untyped-def]
    """len(row.alloc[:n]) for Ownership._reach's n (a negative n slices from the end)."""
    ntok = rows.tok_off[r + 1] - rows.tok_off[r]
    n = cdiv(rows.committed[r] + max(ntok, rows.q_len[r]), B)
    na = rows.alloc_off[r + 1] - rows.alloc_off[r]
    if n < 0:
        n = max(na + n, 0)
    return min(n, na)


@helper
def _new_entry(own, ri, step):  # type: ignore[no-untyped-def]
    g = own.g
    e = g[G_EFREE]
    g[G_EFREE] = own.e_snext[e]
    g[G_ELIVE] += 1
    own.e_req[e], own.e_step[e] = ri, step
    own.e_snext[e] = own.shead[step]
    own.shead[step] = e
    head = own.rhead[ri]
    own.e_rprev[e], own.e_rnext[e] = -1, head
    if head != -1:
        own.e_rprev[head] = e
    own.rhead[ri] = e
    return e


@helper
def _drop_step(own, step, processed):  # type: ignore[no-untyped-def]
    """Free the step's entries; `processed`: Ownership.mark_processing (busy goes down)."""
    g = own.g
    e = own.shead[step]
    while e != -1:
        nxt, ri = own.e_snext[e], own.e_req[e]
        if processed:
            own.busy[ri] -= 1
        prev, after = own.e_rprev[e], own.e_rnext[e]
        if prev != -1:
            own.e_rnext[prev] = after
        else:
            own.rhead[ri] = after
        if after != -1:
            own.e_rprev[after] = prev
        own.e_step[e] = -1
        own.e_snext[e] = g[G_EFREE]
        g[G_EFREE] = e
        g[G_ELIVE] -= 1
        e = nxt
    own.shead[step] = -1


@helper
def mark_launched(own, rows, step, lo, hi, B):  # type: ignore[no-untyped-def]
    if own.shead[step] != -1:  # the same step launched again: its dict is replaced
        _drop_step(own, step, False)
    for r in range(lo, hi):
        ri = rows.request[r] - own.g[G_RBASE]
        own.busy[ri] += 1
        e = own.rhead[ri]
        if e == -1 or own.e_step[e] != step:  # this step's entry would be the newest
            e = _new_entry(own, ri, step)
        own.e_src[e], own.e_off[e], own.e_len[e] = 0, rows.alloc_off[r], reach_len(rows, r, B)


@helper
def mark_processing(own, step):  # type: ignore[no-untyped-def]
    if 0 <= step < len(own.shead) and own.shead[step] != -1:
        _drop_step(own, step, True)


@helper
def using(own, alloc, ri, block, whole):  # type: ignore[no-untyped-def]
    """Ownership._inflight_using is non-empty: a step in flight has request index ri (whole),
    or one whose row's reach holds `block`."""
    e = own.rhead[ri]
    if whole:
        return e != -1
    while e != -1:
        off, n = own.e_off[e], own.e_len[e]
        if own.e_src[e] == 0:
            if _holds(alloc, off, n, block):
                return True
        elif _holds(own.reach, off, n, block):
            return True
        e = own.e_rnext[e]
    return False


@helper
def _holds(values, off, n, block):  # type: ignore[no-untyped-def]
    for k in range(off, off + n):
        if values[k] == block:
            return True
    return False


@nb.njit(cache=True)
def persist(own, alloc):  # type: ignore[no-untyped-def]
    """The reach of every live entry copied out of the batch (whose buffers go away) into a
    fresh pool; returns it (the caller swaps it in)."""
    total = 0
    for e in range(len(own.e_step)):
        if own.e_step[e] != -1:
            total += own.e_len[e]
    pool = np.empty(total, np.int64)
    k = 0
    for e in range(len(own.e_step)):
        if own.e_step[e] == -1:
            continue
        off, n = own.e_off[e], own.e_len[e]
        if own.e_src[e] == 0:
            pool[k:k + n] = alloc[off:off + n]
        else:
            pool[k:k + n] = own.reach[off:off + n]
        own.e_src[e], own.e_off[e] = 1, k
        k += n
    return pool
