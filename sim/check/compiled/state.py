"""The compiled checker's state: arrays the kernels mutate, sized and grown by Python.

Own mirrors sim/check/ownership.py without Python objects:

    holders of block b    linked list hhead[b] -> hnext[...] of request ids hreq[...]
                          (a multiset, as `holders[b]`; nodes recycled through a free list)
    in flight             one entry per (launched step, request): its row's reach, linked per
                          step (shead/e_snext) and per request (rhead/e_rnext/e_rprev)
    per request           busy, the prefix match of the current admission, at index
                          id - g[G_RBASE] (the lowest id seen: -1, "none" in events, unless a
                          stranger trace has lower ids)

An entry's reach (alloc[:n] of its row) points into the batch being checked (e_src 0) until the
kernel call ends; then `persist` copies the few still in flight into `reach` (e_src 1).
Slots mirrors sim/check/content.py plus a per-page summary (see content.py here).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

# Own.g scalars
(G_HFREE, G_HLIVE, G_EFREE, G_ELIVE, G_USED, G_LAST, G_STAMP, G_NV, G_RBASE, NG) = range(10)
# Model config (cfg)
(C_B, C_NB, C_NULL, C_PLAN_LIMIT, NC) = range(5)


class Own(NamedTuple):
    g: np.ndarray
    hhead: np.ndarray
    hnext: np.ndarray
    hreq: np.ndarray
    refcount: np.ndarray
    stamp: np.ndarray  # per block: last row that exposed it (I4 duplicate pages)
    busy: np.ndarray
    rhead: np.ndarray
    match_has: np.ndarray
    match_val: np.ndarray
    shead: np.ndarray
    e_req: np.ndarray
    e_step: np.ndarray
    e_snext: np.ndarray
    e_rnext: np.ndarray
    e_rprev: np.ndarray
    e_src: np.ndarray
    e_off: np.ndarray
    e_len: np.ndarray
    reach: np.ndarray


class Slots(NamedTuple):
    state: np.ndarray  # int8 per slot (page * B + slot)
    owner: np.ndarray
    pos: np.ndarray
    run_len: np.ndarray  # per page: leading slots WRITTEN at consecutive positions...
    run_base: np.ndarray  # ...starting at this position (meaningful when run_len > 0)
    dirty: np.ndarray  # per page: slots changed since run_len/run_base were computed
    whole: np.ndarray  # per page: run_base when every check of a whole chunk on it passes
    #                    (clean, run_len == B, held); -1 once anything about it changes


class Out(NamedTuple):
    code: np.ndarray  # codes.INVARIANTS index
    step: np.ndarray
    request: np.ndarray


def model_cfg(model: dict) -> np.ndarray:
    """As sim.check.view.Model.from_dict."""
    cfg = np.zeros(NC, np.int64)
    cfg[C_B], cfg[C_NB] = int(model["tokens_per_block"]), int(model["num_blocks"])
    cfg[C_NULL] = bool(model.get("null_block", False))
    cfg[C_PLAN_LIMIT] = int(model.get("max_draft_len", 62)) + 2
    return cfg


def new_own(num_blocks: int) -> Own:
    g = np.zeros(NG, np.int64)
    g[G_HFREE] = g[G_EFREE] = g[G_LAST] = g[G_RBASE] = -1
    empty = {f: np.zeros(0, np.int64) for f in Own._fields}  # grown on demand below
    own = Own(**{**empty, "g": g, "hhead": np.full(num_blocks, -1, np.int64),
                 "refcount": np.zeros(num_blocks, np.int64),
                 "stamp": np.full(num_blocks, -1, np.int64)})
    return grow_entries(grow_nodes(own, 1024), 1024)


def new_slots(num_blocks: int, B: int) -> Slots:
    n = num_blocks * B
    return Slots(np.zeros(n, np.int8), np.full(n, -1, np.int64), np.full(n, -1, np.int64),
                 np.zeros(num_blocks, np.int64), np.zeros(num_blocks, np.int64),
                 np.zeros(num_blocks, np.int8), np.full(num_blocks, -1, np.int64))


def new_out(cap: int = 1024) -> Out:
    return Out(*(np.zeros(cap, np.int64) for _ in range(3)))


def _extend(a: np.ndarray, n: int, fill: int, shift: int = 0) -> np.ndarray:
    """a, moved up by `shift`, in n slots; the rest `fill`."""
    out = np.full(n, fill, a.dtype)
    out[shift:shift + len(a)] = a
    return out


def grow_requests(own: Own, lo: int, hi: int) -> Own:
    """Per-request arrays covering request ids lo..hi (re-based if lo is a new lowest id)."""
    g = own.g
    shift = max(0, int(g[G_RBASE]) - lo)
    n = max(hi - min(lo, int(g[G_RBASE])) + 1, len(own.busy) + shift)
    if shift == 0 and n <= len(own.busy):
        return own
    n = max(n, 2 * len(own.busy))
    g[G_RBASE] -= shift
    live = own.e_step != -1  # entries name a request by index
    own.e_req[live] += shift
    return own._replace(busy=_extend(own.busy, n, 0, shift),
                        rhead=_extend(own.rhead, n, -1, shift),
                        match_has=_extend(own.match_has, n, 0, shift),
                        match_val=_extend(own.match_val, n, 0, shift))


def grow_steps(own: Own, n: int) -> Own:
    if n <= len(own.shead):
        return own
    return own._replace(shead=_extend(own.shead, max(n, 2 * len(own.shead)), -1))


def grow_nodes(own: Own, free: int) -> Own:
    """At least `free` unused holder nodes (each alloc/reuse event takes at most one)."""
    g, old = own.g, len(own.hnext)
    if old - g[G_HLIVE] >= free:
        return own
    n = max(2 * old, old + free)
    hnext, hreq = _extend(own.hnext, n, -1), _extend(own.hreq, n, -1)
    hnext[old:n - 1] = np.arange(old + 1, n)
    hnext[n - 1] = g[G_HFREE]
    g[G_HFREE] = old
    return own._replace(hnext=hnext, hreq=hreq)


def grow_entries(own: Own, free: int) -> Own:
    """At least `free` unused in-flight entries."""
    g, old = own.g, len(own.e_req)
    if old - g[G_ELIVE] >= free:
        return own
    n = max(2 * old, old + free)
    fields = {f: _extend(getattr(own, f), n, -1) for f in
              ("e_req", "e_step", "e_snext", "e_rnext", "e_rprev", "e_src", "e_off", "e_len")}
    fields["e_snext"][old:n - 1] = np.arange(old + 1, n)
    fields["e_snext"][n - 1] = g[G_EFREE]
    g[G_EFREE] = old
    return own._replace(**fields)


def grow_out(out: Out, n: int) -> Out:
    if n <= len(out.code):
        return out
    n = max(n, 2 * len(out.code))
    return Out(*(_extend(a, n, 0) for a in out))
