"""The fast engine's compiled loop: the reference engine's semantics on arrays (numba).

One call runs the engine loop of sim/engine.py (overlap off, no MTP, no reuse, simple cost)
until it is done or must hand control back: its output buffers are nearly full, or it needs the
next arrivals. It returns at the top of an iteration only, so calling it again resumes exactly.
Every rule below cites the reference function it mirrors; tests/unit/test_fast.py holds the two
to the same trace digest.

State lives in arrays the Python driver (sim/fast/engine.py) allocates:

    R[slot, field]   per-request state (sim/fast/fields)    T[slot, i]  block table (logical)
    run[:G_NRUN]     running requests in order (slots)     wait ring   waiting queue (slots)
    pool ring        free blocks, LRU head first           flat        FlashInfer's kv_indices
    A*               pending arrivals [G_AI, G_AN)         G[...]      loop scalars
"""

from __future__ import annotations

import numba as nb
import numpy as np

from sim.fast import fields as fl
from sim.fast.pool import (
    _allocate,
    _cdiv,
    _done,
    _emit,
    _free_blocks,
    _run_remove,
    _violation,
)
from sim.fast.stored import page_lists


@nb.njit(cache=True)
def _arrive(G, K, D, R, wait, slots, AR, cfg):  # type: ignore[no-untyped-def]
    """Engine._arrive + Processor.arrive; AR rows: rid, arrival, P, O, token offset, rejected."""
    while G[fl.G_AI] < G[fl.G_AN] and AR[G[fl.G_AI], 1] <= G[fl.G_NOW]:
        a = AR[G[fl.G_AI]]
        G[fl.G_AI] += 1
        G[fl.G_NSLOT] -= 1
        s = slots[G[fl.G_NSLOT]]
        R[s, :] = 0
        for j, f in enumerate((fl.F_RID, fl.F_ARR, fl.F_P, fl.F_O, fl.F_TOK)):
            R[s, f] = a[j]
        R[s, fl.F_PREFILL], R[s, fl.F_NHOST] = a[2], a[2]
        R[s, fl.F_PREVNEW], R[s, fl.F_FIRST], R[s, fl.F_FIN] = -1, -1, -1
        R[s, fl.F_LIM] = min(a[2] + a[3], cfg[fl.C_MAXSEQ])
        R[s, fl.F_BTC] = _cdiv(R[s, fl.F_LIM], cfg[fl.C_B])  # blocks to completion, no headroom
        R[s, fl.F_LROW] = -1  # no row in the trace yet
        if a[5]:  # Processor._unservable: rejected on arrival, emitted at once
            R[s, fl.F_STATE], R[s, fl.F_REASON], R[s, fl.F_FIN] = fl.S_FIN, 3, a[1]
            _done(K, D, R, s)
            slots[G[fl.G_NSLOT]] = s
            G[fl.G_NSLOT] += 1
            continue
        wait[(G[fl.G_WHEAD] + G[fl.G_WLEN]) % wait.shape[0]] = s
        G[fl.G_WLEN] += 1


@nb.njit(cache=True)
def _schedule(G, K, E, R, T, run, wait, pool, cfg, bs, bstart, bn):  # type: ignore
    """Scheduler.schedule: generation rows first, then context chunks. Fills bs/bstart/bn
    (context rows then generation rows) and returns (number of ctx rows, number of gen rows)."""
    B, maxb = cfg[fl.C_B], cfg[fl.C_MAXB]
    budget = cfg[fl.C_MAXTOK]
    ng = 0
    gen = np.empty(maxb, np.int64)
    for j in range(G[fl.G_NRUN]):
        if ng >= maxb:
            break
        s = run[j]
        if R[s, fl.F_STATE] != fl.S_GEN or R[s, fl.F_PAUSE]:
            continue
        if cfg[fl.C_CLAMP] and cfg[fl.C_MAXPOS] - (R[s, fl.F_NHOST] - 1) < 1:
            continue  # draft_len -1: not even the bonus token fits
        if 1 > budget:
            continue
        need = max(0, _cdiv(R[s, fl.F_C] + 1, B) - R[s, fl.F_A])  # KVManager.reserve
        if need == 0 or _allocate(G, K, E, cfg, pool, T, R, s, need):
            R[s, fl.F_C] += 1
            ok = True
        else:
            ok = cfg[fl.C_POLICY] == fl.GNE  # launched anyway; I1 reports the overrun
            if not ok:  # max-utilization: pause the newest running request (maybe s)
                for v in range(G[fl.G_NRUN] - 1, -1, -1):
                    q = run[v]
                    if not R[q, fl.F_PAUSE]:
                        R[q, fl.F_PAUSE] = 1
                        R[q, fl.F_NPRE] += 1
                        break
        if ok:
            gen[ng] = s
            ng += 1
            budget -= 1
    # Scheduler._schedule_context
    nc = 0
    for j in range(G[fl.G_NRUN]):
        s = run[j]
        if R[s, fl.F_STATE] == fl.S_CTX and not R[s, fl.F_PAUSE] and nc + ng < maxb and budget > 0:
            budget -= _chunk(R, cfg, s, budget, bs, bstart, bn, nc)
            nc = _count(bn, nc)
    while G[fl.G_WLEN] and nc + ng < maxb and budget > 0:
        s = wait[G[fl.G_WHEAD]]
        if not _admit(G, K, E, R, T, run, pool, cfg, s, budget):
            break
        G[fl.G_WHEAD] = (G[fl.G_WHEAD] + 1) % wait.shape[0]
        G[fl.G_WLEN] -= 1
        run[G[fl.G_NRUN]] = s
        G[fl.G_NRUN] += 1
        budget -= _chunk(R, cfg, s, budget, bs, bstart, bn, nc)
        nc = _count(bn, nc)
    for i in range(ng):
        bs[nc + i], bn[nc + i] = gen[i], 1
    return nc, ng


@nb.njit(cache=True)
def _count(bn, nc):  # type: ignore[no-untyped-def]
    """_chunk writes its row at nc with n > 0, or leaves bn[nc] = 0 (no row)."""
    return nc + 1 if bn[nc] > 0 else nc


@nb.njit(cache=True)
def _chunk(R, cfg, s, budget, bs, bstart, bn, nc):  # type: ignore[no-untyped-def]
    left = R[s, fl.F_PREFILL] - R[s, fl.F_CTXPOS]
    cs = cfg[fl.C_CHUNK] if cfg[fl.C_CHUNK] else left
    n = min(left, cs, budget)
    bn[nc] = 0
    if n < left and not cfg[fl.C_CHUNK]:
        return 0
    bs[nc], bstart[nc], bn[nc] = s, R[s, fl.F_CTXPOS], n
    R[s, fl.F_CTXPOS] += n
    return n


@nb.njit(cache=True)
def _admit(G, K, E, R, T, run, pool, cfg, s, budget):  # type: ignore[no-untyped-def]
    """Scheduler._admit with reuse off: the whole prefill reserved up front."""
    if not cfg[fl.C_CHUNK] and R[s, fl.F_PREFILL] > budget:
        return False
    if cfg[fl.C_POLICY] == fl.GNE:  # Scheduler._gne_fits (no spec/overlap headroom in this subset)
        promised = 0
        for j in range(G[fl.G_NRUN]):
            q = run[j]
            if R[q, fl.F_A] > 0:
                promised += max(0, R[q, fl.F_BTC] - R[q, fl.F_A])
        if R[s, fl.F_BTC] > G[fl.G_PLEN] - promised:
            return False
    if not _allocate(G, K, E, cfg, pool, T, R, s, _cdiv(R[s, fl.F_PREFILL], cfg[fl.C_B])):
        return False
    R[s, fl.F_C] = R[s, fl.F_PREFILL]
    R[s, fl.F_STATE], R[s, fl.F_CTXPOS], R[s, fl.F_COMMIT] = fl.S_CTX, 0, 0
    return True


@nb.njit(cache=True)
def _after_schedule(G, K, E, R, T, run, wait, pool, cfg):  # type: ignore[no-untyped-def]
    """Processor.after_schedule: paused requests release their blocks and are requeued
    (nothing is in flight with overlap off)."""
    snap = run[:G[fl.G_NRUN]].copy()
    for s in snap:
        if R[s, fl.F_PAUSE]:
            _free_blocks(G, K, E, cfg, pool, T, R, s)
            _run_remove(G, run, s)  # Scheduler.requeue
            R[s, fl.F_STATE], R[s, fl.F_PAUSE] = fl.S_WAIT, 0
            R[s, fl.F_PREFILL], R[s, fl.F_CTXPOS], R[s, fl.F_COMMIT] = R[s, fl.F_NHOST], 0, 0
            R[s, fl.F_PREVNEW] = -1
            G[fl.G_WHEAD] = (G[fl.G_WHEAD] - 1) % wait.shape[0]
            wait[G[fl.G_WHEAD]] = s
            G[fl.G_WLEN] += 1


@nb.njit(cache=True)
def _plan(G, cfg, seen, gen_w, batch):  # type: ignore[no-untyped-def]
    """MetadataBuilder.plan -> (plan_q_len, plan_cache_size)."""
    key = cfg[fl.C_PLANKEY]
    if key == fl.P_FRESH or gen_w == 0:
        return -1, max(1, G[fl.G_NPLANS])
    k = 0 if key == fl.P_NOWIDTH else batch
    if seen[k]:
        return 1, G[fl.G_NPLANS]
    seen[k] = 1
    G[fl.G_NPLANS] += 1
    return -1, G[fl.G_NPLANS]


@nb.njit(cache=True)
def _launch(G, K, E, S, W, PG, AL, TK, R, T, LP, LA, flat, toks, seen, cfg, bs, bstart, bn,
            nc, ng, t_sched):  # type: ignore[no-untyped-def]
    """Engine._launch + build_rows: the step's rows (engine metadata next to device truth)."""
    B, k, n = cfg[fl.C_B], G[fl.G_STEP], nc + ng
    detail = cfg[fl.C_DETAIL]
    whole = detail and not cfg[fl.C_DELTA]  # rows' lists written out whole (else page_lists)
    r0 = K[fl.K_R]
    pos = 0  # write cursor into flat (get_batch_cache_indices_flat packs what it copies)
    indptr = 0
    tokens = 0
    kv_sum = 0
    spare = 0
    for i in range(n):
        s, w = bs[i], W[r0 + i]
        c = R[s, fl.F_COMMIT]
        if i < nc:  # MetadataBuilder.ctx_lengths
            q = bn[i]
            L = bstart[i] + q
            cached_host, kv_len_host, nbk, append = bstart[i], L, _cdiv(L, B), bstart[i]
        else:  # gen_lengths, W = 1, nothing in flight: host view = device truth
            q = 1
            L = c + 1
            cached_host, kv_len_host, append = c, L, c
            logical = _cdiv(L, B)
            nbk = max(logical, R[s, fl.F_A]) if cfg[fl.C_WIDTH] == fl.W_RESERVED else logical
        lpl = L - (_cdiv(L, B) - 1) * B  # kernel_len
        kv_len = (nbk - 1) * B + lpl if cfg[fl.C_BACKEND] == fl.FA2 else L
        own = min(nbk, R[s, fl.F_A])
        w[fl.W_STEP], w[fl.W_ROW], w[fl.W_REQ] = k, i, R[s, fl.F_RID]
        w[fl.W_PHASE], w[fl.W_Q] = i >= nc, q
        w[fl.W_LPL], w[fl.W_KVLEN], w[fl.W_APPEND], w[fl.W_ROPE] = lpl, kv_len, append, c
        w[fl.W_CACHED_HOST], w[fl.W_KVLEN_HOST], w[fl.W_COMMIT] = cached_host, kv_len_host, c
        w[fl.W_RESERVED], w[fl.W_NEW] = R[s, fl.F_C], q
        w[fl.W_ACCEPTED] = -1 if i < nc else 0
        w[fl.W_PREVNEW] = -1 if i < nc else R[s, fl.F_PREVNEW]
        w[fl.W_NPAGES], w[fl.W_NALLOC], w[fl.W_NTOK] = nbk, R[s, fl.F_A], q
        if cfg[fl.C_BACKEND] == fl.XQA:  # block table row: own pages, then -1
            w[fl.W_KVINDPTR] = 0
            if whole:
                p = K[fl.K_PG]
                PG[p:p + own] = T[s, :own]
                PG[p + own:p + nbk] = -1
                K[fl.K_PG] = p + nbk
        else:
            w[fl.W_KVINDPTR] = indptr
            if detail:
                flat[pos:pos + own] = T[s, :own]
            pos += own
            indptr += nbk
        if whole:
            a = K[fl.K_AL]
            AL[a:a + R[s, fl.F_A]] = T[s, :R[s, fl.F_A]]
            K[fl.K_AL] = a + R[s, fl.F_A]
        if detail:
            t = K[fl.K_TK]
            TK[t:t + q] = toks[R[s, fl.F_TOK] + c:R[s, fl.F_TOK] + c + q]
            K[fl.K_TK] = t + q
        tokens += q
        kv_sum += kv_len
        spare += R[s, fl.F_C] - c - q
        # device truth advances at launch
        R[s, fl.F_COMMIT] = c + q
        R[s, fl.F_PREVNEW] = 1
        if i >= nc:
            R[s, fl.F_GSTEPS] += 1
        elif R[s, fl.F_CTXPOS] >= R[s, fl.F_PREFILL]:
            R[s, fl.F_STATE] = fl.S_GEN
    if whole and cfg[fl.C_BACKEND] != fl.XQA:  # the rows read flat through kv_indptr
        p = K[fl.K_PG]
        PG[p:p + indptr] = flat[:indptr]
        K[fl.K_PG] = p + indptr
    elif detail and not whole:  # once every row is in flat: a row reads past its own pages
        page_lists(G, K, W, PG, AL, R, T, LP, LA, flat, cfg, bs, r0, n)
    K[fl.K_R] = r0 + n
    now = G[fl.G_NOW]
    start = max(now, G[fl.G_DEVFREE])
    end = start + cfg[fl.C_STEP_BASE] + cfg[fl.C_NS_TOK] * tokens + cfg[fl.C_NS_KV] * kv_sum
    G[fl.G_DEVFREE] = end
    plan_q, plan_n = _plan(G, cfg, seen, 1 if ng else 0, n)
    used = cfg[fl.C_USABLE] - G[fl.G_PLEN]
    srow = S[K[fl.K_S]]
    srow[0], srow[1], srow[2], srow[3], srow[4] = k, t_sched, now, start, end
    srow[5], srow[6], srow[7], srow[8] = n, nc, ng, tokens
    srow[9], srow[10], srow[11] = plan_q, n, plan_n
    srow[12], srow[13], srow[14], srow[15], srow[16] = used, G[fl.G_PLEN], 0, 0, -1
    srow[17] = spare
    K[fl.K_S] += 1
    G[fl.G_EVSTEP], G[fl.G_EVPHASE] = k, 1
    G[fl.G_STEP] = k + 1
    return r0, end


@nb.njit(cache=True)
def _process(G, K, E, D, V, W, R, T, run, pool, slots, cfg, bs, r0, n):  # type: ignore
    """Processor.process with overlap off: apply each row, finish, free."""
    k = W[r0, fl.W_STEP]
    now = G[fl.G_NOW]
    _emit(G, K, E, cfg, fl.E_DONE, -1, -1, 0, k)
    for i in range(n):
        s, w = bs[i], W[r0 + i]
        if w[fl.W_PHASE]:  # gen: one new token; the reservation already matches (no rewind)
            R[s, fl.F_NHOST] += 1
        elif w[fl.W_COMMIT] + w[fl.W_Q] >= R[s, fl.F_PREFILL]:
            R[s, fl.F_NHOST] = R[s, fl.F_PREFILL] + 1
            if R[s, fl.F_FIRST] < 0:
                R[s, fl.F_FIRST] = now
        else:
            continue
        if R[s, fl.F_NHOST] >= R[s, fl.F_LIM]:
            R[s, fl.F_NHOST] = R[s, fl.F_LIM]
            R[s, fl.F_REASON] = 1 if R[s, fl.F_LIM] == R[s, fl.F_P] + R[s, fl.F_O] else 2
            R[s, fl.F_STATE], R[s, fl.F_FIN] = fl.S_FIN, now
            _free_blocks(G, K, E, cfg, pool, T, R, s)
            _run_remove(G, run, s)
            _done(K, D, R, s)
            slots[G[fl.G_NSLOT]] = s
            G[fl.G_NSLOT] += 1
        elif w[fl.W_PHASE] and R[s, fl.F_C] != R[s, fl.F_NHOST] - 1:
            _violation(K, V, fl.V_I18, k, R[s, fl.F_RID], R[s, fl.F_C], R[s, fl.F_NHOST] - 1)
    G[fl.G_PROCESSED] = k


# nogil: one call runs ~8 ms of nopython code; holding the GIL that long stalls the trace
# writer's thread (Parquet encoding, the digest) between its calls into Arrow and hashlib.
@nb.njit(cache=True, nogil=True)
def loop(G, K, cfg, room, R, T, LP, LA, run, wait, pool, slots, flat, toks, seen, AR,
         S, W, PG, AL, TK, E, D, V):  # type: ignore[no-untyped-def]
    """Engine._loop (overlap off). Returns DONE, NEED_ARRIVALS or FLUSH (buffers nearly full:
    `room` holds the headroom one more iteration needs in each output buffer)."""
    maxb = cfg[fl.C_MAXB]
    bs = np.empty(maxb + 1, np.int64)
    bstart = np.empty(maxb + 1, np.int64)
    bn = np.empty(maxb + 1, np.int64)
    caps = (S.shape[0], W.shape[0], PG.shape[0], AL.shape[0], TK.shape[0], E.shape[0],
            D.shape[0], V.shape[0])
    while True:
        for i in range(fl.NK - 1):
            if K[i] + room[i] > caps[i]:
                return fl.FLUSH
        # every pending arrival may be rejected at once: room for all their records
        if K[fl.K_D] + G[fl.G_AN] - G[fl.G_AI] + room[fl.K_D] > caps[fl.K_D]:
            return fl.FLUSH
        if G[fl.G_MORE] and (G[fl.G_AI] == G[fl.G_AN] or AR[G[fl.G_AN] - 1, 1] <= G[fl.G_NOW]):
            return fl.NEED_ARRIVALS  # the next arrival after now must be known (Engine.next_spec)
        _arrive(G, K, D, R, wait, slots, AR, cfg)
        t_sched = G[fl.G_NOW]
        nc, ng = _schedule(G, K, E, R, T, run, wait, pool, cfg, bs, bstart, bn)
        _after_schedule(G, K, E, R, T, run, wait, pool, cfg)
        if nc + ng == 0:
            if G[fl.G_AI] < G[fl.G_AN]:
                G[fl.G_NOW] = max(G[fl.G_NOW], AR[G[fl.G_AI], 1])
            elif G[fl.G_NRUN] or G[fl.G_WLEN]:
                if G[fl.G_PLEN] != G[fl.G_STALL]:
                    G[fl.G_STALL] = G[fl.G_PLEN]
                    continue
                head = wait[G[fl.G_WHEAD]] if G[fl.G_WLEN] else run[0]
                _violation(K, V, fl.V_LIVENESS, G[fl.G_STEP], R[head, fl.F_RID], G[fl.G_PLEN], 0)
                return fl.DONE
            else:
                return fl.DONE
            continue
        G[fl.G_STALL] = -1
        G[fl.G_NOW] += cfg[fl.C_HOST_BASE] + cfg[fl.C_HOST_ROW] * (nc + ng)
        r0, end = _launch(G, K, E, S, W, PG, AL, TK, R, T, LP, LA, flat, toks, seen, cfg, bs,
                          bstart, bn, nc, ng, t_sched)
        if end > G[fl.G_NOW]:
            G[fl.G_NOW] = end
        _process(G, K, E, D, V, W, R, T, run, pool, slots, cfg, bs, r0, nc + ng)
