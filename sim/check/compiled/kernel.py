"""The compiled merge loop: a batch's block events and launches in the checker's call order,
(step, rank, seq) with a launch at (step, LAUNCH_RANK), in one call without Python per step.

It stops early, between two items, when the violation buffer or the in-flight entries might
not hold the next item's output (the driver grows them and calls again: the cursor `cur`
says where to resume), or at the first item of step >= `stop` (held back for the next feed).

numba's cache keys on this file alone, but the helpers it inlines live in the other modules
here: sim/jit_cache.py empties the package's cache whenever any of its sources changes.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from sim.check.compiled import codes as cd
from sim.check.compiled.common import emit, entry
from sim.check.compiled.launch import launch
from sim.check.compiled.pool import block_event
from sim.check.compiled.state import C_NB, G_ELIVE, G_LAST, G_NV, G_RBASE, G_USED

_EVENT_ROOM = 3  # an alloc: taken-from, null block, refcount
_STEP_ROOM = 6  # I14 x3, I20, POOL x2; plus one per row and row check


@entry
def run(own, slots, out, cfg, steps, row_lo, row_hi, rows, ev, cur, stop, scratch):  # type: ignore
    n_ev, n_st = len(ev.step), len(steps.step)
    g = own.g
    while True:
        ie, js = cur[0], cur[1]
        room = len(out.code) - g[G_NV]
        if ie < n_ev and (js >= n_st or ev.step[ie] < steps.step[js] or (
                ev.step[ie] == steps.step[js] and ev.rank[ie] == cd.SCHED_RANK)):
            if ev.step[ie] >= stop:
                return cd.DONE_STATUS
            if room < _EVENT_ROOM:
                return cd.NEED_VIOLATIONS
            block_event(own, slots, out, cfg, ev, ie, rows.alloc)
            cur[0] = ie + 1
        elif js < n_st:
            if steps.step[js] >= stop:
                return cd.DONE_STATUS
            n = row_hi[js] - row_lo[js]
            if room < _STEP_ROOM + cd.N_ROW_CHECKS * n:
                return cd.NEED_VIOLATIONS
            if len(own.e_req) - g[G_ELIVE] < n:
                return cd.NEED_ENTRIES
            launch(own, slots, out, cfg, steps, js, row_lo[js], row_hi[js], rows, scratch)
            cur[1] = js + 1
        else:
            return cd.DONE_STATUS


@nb.njit(cache=True)
def finish(own, out, cfg):  # type: ignore[no-untyped-def]
    """Ownership.finish: requests still holding blocks (by id), then a pool not idle."""
    last = own.g[G_LAST]
    holds = np.zeros(len(own.busy), np.bool_)
    for b in range(cfg[C_NB]):
        node = own.hhead[b]
        while node != -1:
            holds[own.hreq[node] - own.g[G_RBASE]] = True
            node = own.hnext[node]
    for ri in range(len(holds)):
        if holds[ri]:
            emit(out, own.g, cd.V_I17, last, ri + own.g[G_RBASE])
    if own.g[G_USED]:
        emit(out, own.g, cd.V_POOL, last, -1)
