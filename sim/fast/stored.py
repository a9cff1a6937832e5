"""The trace-only run's rows, as rows.parquet stores them (docs/trace.md, format 3).

When nothing but the trace writer takes the rows (no online checker), the fast engine's loop
hands over each row's `pages` and `alloc` already delta-encoded: sim/trace/delta.py's rule,
applied against each request slot's last lists (LP, LA) and a low-water mark of its block table
(R[:, F_TLOW]), so the ~600M page ids per 10k requests are never written out whole.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from sim.fast import fields as fl


@nb.njit(cache=True)
def page_lists(G, K, W, PG, AL, R, T, LP, LA, flat, cfg, bs, r0, n):  # type: ignore
    """The step's rows' `pages` and `alloc` into PG and AL as rows.parquet stores them (cfg
    C_DELTA: a trace without the checker), the tail after the prefix shared with the
    request's previous row. That is RowEncoder's rule (sim/trace/delta.py) on the row
    sequence, computed here against LP/LA, each slot's last lists, instead of writing ~600M
    page ids per 10k requests out whole for the encoder to compare and drop again.

    Flat arrays and offsets, not row slices: each slice is a reference-counted view, and a
    few per row cost more than the work (most rows compare nothing and copy 0-1 ids)."""
    xqa, width = cfg[fl.C_BACKEND] == fl.XQA, T.shape[1]
    t_all, lp_all, la_all = T.reshape(-1), LP.reshape(-1), LA.reshape(-1)
    scratch = np.full(width, -1, np.int32)
    for i in range(n):
        s, w = bs[i], W[r0 + i]
        nbk, a = w[fl.W_NPAGES], w[fl.W_NALLOC]
        ordinal, last = G[fl.G_ROWS], R[s, fl.F_LROW]
        ok = last >= 0 and ordinal - last <= cfg[fl.C_WINDOW]
        w[fl.W_PREV] = last if ok else -1
        # below `same`, the last row's lists were T's and T is unchanged: nothing to compare
        same = min(R[s, fl.F_TLOW], R[s, fl.F_LPN], R[s, fl.F_LAN]) if ok else 0
        if xqa:  # the block table row: own pages, then -1
            own = min(nbk, a)
            scratch[:own] = T[s, :own]
            scratch[own:nbk] = -1
            src, at = scratch, 0
        else:  # FlashInfer reads kv_indices from kv_indptr on, past its own pages if nbk > own
            src, at = flat, w[fl.W_KVINDPTR]
        kp = _put(src, at, nbk, lp_all, s * width, R[s, fl.F_LPN], same, ok, PG, K[fl.K_PG])
        ka = _put(t_all, s * width, a, la_all, s * width, R[s, fl.F_LAN], same, ok, AL,
                  K[fl.K_AL])
        K[fl.K_PG] += nbk - kp
        K[fl.K_AL] += a - ka
        w[fl.W_PKEEP], w[fl.W_AKEEP], w[fl.W_PTAIL], w[fl.W_ATAIL] = kp, ka, nbk - kp, a - ka
        R[s, fl.F_LROW], R[s, fl.F_LPN], R[s, fl.F_LAN] = ordinal, nbk, a
        R[s, fl.F_TLOW] = width
        G[fl.G_ROWS] = ordinal + 1


@nb.njit(cache=True)
def _put(src, at, n, last, lat, n_last, same, ok, out, o):  # type: ignore
    """List src[at:at+n] into out[o:], after the prefix it shares with last[lat:lat+n_last]
    (only if ok: else whole), known to share at least `same`; it becomes last. Returns the
    shared prefix's length. Loops, not slices: a tail is 0-1 ids at most rows, and a slice is
    a reference-counted view."""
    k = 0
    if ok:
        m = min(n_last, n)
        k = min(same, m)
        while k < m and last[lat + k] == src[at + k]:
            k += 1
    for j in range(k, n):
        out[o + j - k] = src[at + j]
        last[lat + j] = src[at + j]
    return k
