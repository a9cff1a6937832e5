"""The fast engine's compiled loop: the reference engine's semantics on arrays (numba).

One call runs the engine loop of sim/engine.py (overlap off, no MTP, no reuse, simple cost)
until it is done or must hand control back: its output buffers are nearly full, or it needs the
next arrivals. It returns at the top of an iteration only, so calling it again resumes exactly.
Every rule below cites the reference function it mirrors; tests/unit/test_fast.py holds the two
to the same trace digest.

State lives in arrays the Python driver (sim/fast/engine.py) allocates:

    R[slot, field]   per-request state (fields below)      T[slot, i]  block table (logical)
    run[:G_NRUN]     running requests in order (slots)     wait ring   waiting queue (slots)
    pool ring        free blocks, LRU head first           flat        FlashInfer's kv_indices
    A*               pending arrivals [G_AI, G_AN)         G[...]      loop scalars
"""

from __future__ import annotations

import numba as nb
import numpy as np

# -- per-request fields (columns of R) -------------------------------------------------------
(F_RID, F_ARR, F_P, F_O, F_TOK, F_STATE, F_PREFILL, F_CTXPOS, F_COMMIT, F_NHOST, F_C, F_A,
 F_GSTEPS, F_PREVNEW, F_FIRST, F_FIN, F_REASON, F_NPRE, F_PAUSE, F_LIM, F_BTC, NF) = range(22)
# states (sim.request.State) and finish reasons
S_WAIT, S_CTX, S_GEN, S_FIN = 0, 1, 2, 3
REASONS = ("unfinished", "length", "max_seq_len", "rejected")
# loop scalars (G)
(G_NOW, G_STEP, G_DEVFREE, G_STALL, G_SEQ, G_EVSTEP, G_EVPHASE, G_NRUN, G_WHEAD, G_WLEN,
 G_PHEAD, G_PLEN, G_AI, G_AN, G_MORE, G_NSLOT, G_NPLANS, G_PROCESSED, NG) = range(19)
# output counters (K)
(K_S, K_R, K_PG, K_AL, K_TK, K_E, K_D, K_V, NK) = range(9)
# configuration (cfg)
(C_B, C_MAXB, C_MAXTOK, C_CHUNK, C_POLICY, C_BACKEND, C_WIDTH, C_CLAMP, C_MAXPOS, C_MAXSEQ,
 C_PLANKEY, C_USABLE, C_DETAIL, C_STEP_BASE, C_NS_TOK, C_NS_KV, C_HOST_BASE, C_HOST_ROW,
 NC) = range(19)
GNE, MAXUTIL = 1, 0
FA2, FA3, XQA = 0, 1, 2
W_RESERVED, W_LHOST, W_LDEV = 0, 1, 2
P_FRESH, P_NOWIDTH, P_PERBATCH = 0, 1, 2
# event codes (sim.kv.events), violation codes
E_ALLOC, E_FREE, E_DONE = 0, 1, 2
EVENTS = ("alloc", "free", "done")
V_I18, V_LIVENESS = 0, 1
# step columns (S) and row columns (W)
NS = 18  # StepRecord's 17 ints without backend, + spare slots (kv series)
(W_STEP, W_ROW, W_REQ, W_PHASE, W_Q, W_KVINDPTR, W_LPL, W_KVLEN, W_APPEND, W_ROPE,
 W_CACHED_HOST, W_KVLEN_HOST, W_COMMIT, W_RESERVED, W_ACCEPTED, W_NEW, W_PREVNEW, W_NPAGES,
 W_NALLOC, W_NTOK, NW) = range(21)
# done-request columns (D)
(D_RID, D_ARR, D_P, D_O, D_TOK, D_NHOST, D_FIRST, D_FIN, D_REASON, D_NPRE, D_GSTEPS, ND) = range(12)
# codes the loop returns with
DONE, NEED_ARRIVALS, FLUSH = 0, 1, 2


@nb.njit(cache=True)
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@nb.njit(cache=True)
def _emit(G, K, E, cfg, ev, block, req, refcount, src):  # type: ignore[no-untyped-def]
    """EventLog.emit: the sequence number moves even when events are not recorded."""
    if cfg[C_DETAIL]:
        i = K[K_E]
        E[i, 0], E[i, 1], E[i, 2], E[i, 3] = G[G_EVSTEP], G[G_EVPHASE], G[G_SEQ], ev
        E[i, 4], E[i, 5], E[i, 6], E[i, 7] = block, req, refcount, src
        K[K_E] = i + 1
    G[G_SEQ] += 1


@nb.njit(cache=True)
def _allocate(G, K, E, cfg, pool, T, R, s, n):  # type: ignore[no-untyped-def]
    """BlockPool.allocate + KVManager bookkeeping: n blocks from the LRU head onto slot s."""
    if n > G[G_PLEN]:
        return False
    N = pool.shape[0]
    for _ in range(n):
        b = pool[G[G_PHEAD]]
        G[G_PHEAD] = (G[G_PHEAD] + 1) % N
        G[G_PLEN] -= 1
        _emit(G, K, E, cfg, E_ALLOC, b, R[s, F_RID], 1, -1)
        T[s, R[s, F_A]] = b
        R[s, F_A] += 1
    return True


@nb.njit(cache=True)
def _free_blocks(G, K, E, cfg, pool, T, R, s):  # type: ignore[no-untyped-def]
    """KVManager.free: every block back to the LRU tail, last block first."""
    N = pool.shape[0]
    for i in range(R[s, F_A] - 1, -1, -1):
        pool[(G[G_PHEAD] + G[G_PLEN]) % N] = T[s, i]
        G[G_PLEN] += 1
        _emit(G, K, E, cfg, E_FREE, T[s, i], R[s, F_RID], 0, -1)
    R[s, F_A] = 0
    R[s, F_C] = 0


@nb.njit(cache=True)
def _run_remove(G, run, s):  # type: ignore[no-untyped-def]
    n = G[G_NRUN]
    j = 0
    while run[j] != s:
        j += 1
    run[j:n - 1] = run[j + 1:n]
    G[G_NRUN] = n - 1


@nb.njit(cache=True)
def _done(K, D, R, s):  # type: ignore[no-untyped-def]
    """Processor._emit: the request record, in emission order (the requests table's order)."""
    i = K[K_D]
    D[i, D_RID], D[i, D_ARR], D[i, D_P], D[i, D_O] = R[s, F_RID], R[s, F_ARR], R[s, F_P], R[s, F_O]
    D[i, D_TOK], D[i, D_NHOST], D[i, D_FIRST] = R[s, F_TOK], R[s, F_NHOST], R[s, F_FIRST]
    D[i, D_FIN], D[i, D_REASON], D[i, D_NPRE] = R[s, F_FIN], R[s, F_REASON], R[s, F_NPRE]
    D[i, D_GSTEPS] = R[s, F_GSTEPS]
    K[K_D] = i + 1


@nb.njit(cache=True)
def _violation(K, V, code, step, rid, x, y):  # type: ignore[no-untyped-def]
    i = K[K_V]
    V[i, 0], V[i, 1], V[i, 2], V[i, 3], V[i, 4] = code, step, rid, x, y
    K[K_V] = i + 1


@nb.njit(cache=True)
def _arrive(G, K, D, R, wait, slots, AR, cfg):  # type: ignore[no-untyped-def]
    """Engine._arrive + Processor.arrive; AR rows: rid, arrival, P, O, token offset, rejected."""
    while G[G_AI] < G[G_AN] and AR[G[G_AI], 1] <= G[G_NOW]:
        a = AR[G[G_AI]]
        G[G_AI] += 1
        G[G_NSLOT] -= 1
        s = slots[G[G_NSLOT]]
        R[s, :] = 0
        R[s, F_RID], R[s, F_ARR], R[s, F_P], R[s, F_O], R[s, F_TOK] = a[0], a[1], a[2], a[3], a[4]
        R[s, F_PREFILL], R[s, F_NHOST] = a[2], a[2]
        R[s, F_PREVNEW], R[s, F_FIRST], R[s, F_FIN] = -1, -1, -1
        R[s, F_LIM] = min(a[2] + a[3], cfg[C_MAXSEQ])
        R[s, F_BTC] = _cdiv(R[s, F_LIM], cfg[C_B])  # blocks to completion, no headroom
        if a[5]:  # Processor._unservable: rejected on arrival, emitted at once
            R[s, F_STATE], R[s, F_REASON], R[s, F_FIN] = S_FIN, 3, a[1]
            _done(K, D, R, s)
            slots[G[G_NSLOT]] = s
            G[G_NSLOT] += 1
            continue
        wait[(G[G_WHEAD] + G[G_WLEN]) % wait.shape[0]] = s
        G[G_WLEN] += 1


@nb.njit(cache=True)
def _schedule(G, K, E, R, T, run, wait, pool, cfg, bs, bstart, bn):  # type: ignore
    """Scheduler.schedule: generation rows first, then context chunks. Fills bs/bstart/bn
    (context rows then generation rows) and returns (number of ctx rows, number of gen rows)."""
    B, maxb = cfg[C_B], cfg[C_MAXB]
    budget = cfg[C_MAXTOK]
    ng = 0
    gen = np.empty(maxb, np.int64)
    for j in range(G[G_NRUN]):
        if ng >= maxb:
            break
        s = run[j]
        if R[s, F_STATE] != S_GEN or R[s, F_PAUSE]:
            continue
        if cfg[C_CLAMP] and cfg[C_MAXPOS] - (R[s, F_NHOST] - 1) < 1:
            continue  # draft_len -1: not even the bonus token fits
        if 1 > budget:
            continue
        need = max(0, _cdiv(R[s, F_C] + 1, B) - R[s, F_A])  # KVManager.reserve
        if need == 0 or _allocate(G, K, E, cfg, pool, T, R, s, need):
            R[s, F_C] += 1
            ok = True
        else:
            ok = cfg[C_POLICY] == GNE  # launched anyway; I1 reports the overrun
            if not ok:  # max-utilization: pause the newest running request (maybe s)
                for v in range(G[G_NRUN] - 1, -1, -1):
                    q = run[v]
                    if not R[q, F_PAUSE]:
                        R[q, F_PAUSE] = 1
                        R[q, F_NPRE] += 1
                        break
        if ok:
            gen[ng] = s
            ng += 1
            budget -= 1
    # Scheduler._schedule_context
    nc = 0
    for j in range(G[G_NRUN]):
        s = run[j]
        if R[s, F_STATE] == S_CTX and not R[s, F_PAUSE] and nc + ng < maxb and budget > 0:
            budget -= _chunk(R, cfg, s, budget, bs, bstart, bn, nc)
            nc = _count(bn, nc)
    while G[G_WLEN] and nc + ng < maxb and budget > 0:
        s = wait[G[G_WHEAD]]
        if not _admit(G, K, E, R, T, run, pool, cfg, s, budget):
            break
        G[G_WHEAD] = (G[G_WHEAD] + 1) % wait.shape[0]
        G[G_WLEN] -= 1
        run[G[G_NRUN]] = s
        G[G_NRUN] += 1
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
    left = R[s, F_PREFILL] - R[s, F_CTXPOS]
    cs = cfg[C_CHUNK] if cfg[C_CHUNK] else left
    n = min(left, cs, budget)
    bn[nc] = 0
    if n < left and not cfg[C_CHUNK]:
        return 0
    bs[nc], bstart[nc], bn[nc] = s, R[s, F_CTXPOS], n
    R[s, F_CTXPOS] += n
    return n


@nb.njit(cache=True)
def _admit(G, K, E, R, T, run, pool, cfg, s, budget):  # type: ignore[no-untyped-def]
    """Scheduler._admit with reuse off: the whole prefill reserved up front."""
    if not cfg[C_CHUNK] and R[s, F_PREFILL] > budget:
        return False
    if cfg[C_POLICY] == GNE:  # Scheduler._gne_fits (no spec/overlap headroom in this subset)
        promised = 0
        for j in range(G[G_NRUN]):
            q = run[j]
            if R[q, F_A] > 0:
                promised += max(0, R[q, F_BTC] - R[q, F_A])
        if R[s, F_BTC] > G[G_PLEN] - promised:
            return False
    if not _allocate(G, K, E, cfg, pool, T, R, s, _cdiv(R[s, F_PREFILL], cfg[C_B])):
        return False
    R[s, F_C] = R[s, F_PREFILL]
    R[s, F_STATE], R[s, F_CTXPOS], R[s, F_COMMIT] = S_CTX, 0, 0
    return True


@nb.njit(cache=True)
def _after_schedule(G, K, E, R, T, run, wait, pool, cfg):  # type: ignore[no-untyped-def]
    """Processor.after_schedule: paused requests release their blocks and are requeued
    (nothing is in flight with overlap off)."""
    snap = run[:G[G_NRUN]].copy()
    for s in snap:
        if R[s, F_PAUSE]:
            _free_blocks(G, K, E, cfg, pool, T, R, s)
            _run_remove(G, run, s)  # Scheduler.requeue
            R[s, F_STATE], R[s, F_PAUSE] = S_WAIT, 0
            R[s, F_PREFILL], R[s, F_CTXPOS], R[s, F_COMMIT] = R[s, F_NHOST], 0, 0
            R[s, F_PREVNEW] = -1
            G[G_WHEAD] = (G[G_WHEAD] - 1) % wait.shape[0]
            wait[G[G_WHEAD]] = s
            G[G_WLEN] += 1


@nb.njit(cache=True)
def _plan(G, cfg, seen, gen_w, batch):  # type: ignore[no-untyped-def]
    """MetadataBuilder.plan -> (plan_q_len, plan_cache_size)."""
    key = cfg[C_PLANKEY]
    if key == P_FRESH or gen_w == 0:
        return -1, max(1, G[G_NPLANS])
    k = 0 if key == P_NOWIDTH else batch
    if seen[k]:
        return 1, G[G_NPLANS]
    seen[k] = 1
    G[G_NPLANS] += 1
    return -1, G[G_NPLANS]


@nb.njit(cache=True)
def _launch(G, K, E, S, W, PG, AL, TK, R, T, flat, toks, seen, cfg, bs, bstart, bn, nc, ng,
            t_sched):  # type: ignore[no-untyped-def]
    """Engine._launch + build_rows: the step's rows (engine metadata next to device truth)."""
    B, k, n = cfg[C_B], G[G_STEP], nc + ng
    detail = cfg[C_DETAIL]
    r0 = K[K_R]
    pos = 0  # write cursor into flat (get_batch_cache_indices_flat packs what it copies)
    indptr = 0
    tokens = 0
    kv_sum = 0
    spare = 0
    for i in range(n):
        s, w = bs[i], W[r0 + i]
        c = R[s, F_COMMIT]
        if i < nc:  # MetadataBuilder.ctx_lengths
            q = bn[i]
            L = bstart[i] + q
            cached_host, kv_len_host, nbk, append = bstart[i], L, _cdiv(L, B), bstart[i]
        else:  # gen_lengths, W = 1, nothing in flight: host view = device truth
            q = 1
            L = c + 1
            cached_host, kv_len_host, append = c, L, c
            logical = _cdiv(L, B)
            nbk = max(logical, R[s, F_A]) if cfg[C_WIDTH] == W_RESERVED else logical
        lpl = L - (_cdiv(L, B) - 1) * B  # kernel_len
        kv_len = (nbk - 1) * B + lpl if cfg[C_BACKEND] == FA2 else L
        own = min(nbk, R[s, F_A])
        w[W_STEP], w[W_ROW], w[W_REQ], w[W_PHASE], w[W_Q] = k, i, R[s, F_RID], i >= nc, q
        w[W_LPL], w[W_KVLEN], w[W_APPEND], w[W_ROPE] = lpl, kv_len, append, c
        w[W_CACHED_HOST], w[W_KVLEN_HOST], w[W_COMMIT] = cached_host, kv_len_host, c
        w[W_RESERVED], w[W_NEW] = R[s, F_C], q
        w[W_ACCEPTED] = -1 if i < nc else 0
        w[W_PREVNEW] = -1 if i < nc else R[s, F_PREVNEW]
        w[W_NPAGES], w[W_NALLOC], w[W_NTOK] = nbk, R[s, F_A], q
        if cfg[C_BACKEND] == XQA:  # block table row: own pages, then -1
            w[W_KVINDPTR] = 0
            if detail:
                p = K[K_PG]
                PG[p:p + own] = T[s, :own]
                PG[p + own:p + nbk] = -1
                K[K_PG] = p + nbk
        else:
            w[W_KVINDPTR] = indptr
            if detail:
                flat[pos:pos + own] = T[s, :own]
            pos += own
            indptr += nbk
        if detail:
            a = K[K_AL]
            AL[a:a + R[s, F_A]] = T[s, :R[s, F_A]]
            K[K_AL] = a + R[s, F_A]
            t = K[K_TK]
            TK[t:t + q] = toks[R[s, F_TOK] + c:R[s, F_TOK] + c + q]
            K[K_TK] = t + q
        tokens += q
        kv_sum += kv_len
        spare += R[s, F_C] - c - q
        # device truth advances at launch
        R[s, F_COMMIT] = c + q
        R[s, F_PREVNEW] = 1
        if i >= nc:
            R[s, F_GSTEPS] += 1
        elif R[s, F_CTXPOS] >= R[s, F_PREFILL]:
            R[s, F_STATE] = S_GEN
    if detail and cfg[C_BACKEND] != XQA:  # the rows read the flat buffer through kv_indptr
        p = K[K_PG]
        PG[p:p + indptr] = flat[:indptr]
        K[K_PG] = p + indptr
    K[K_R] = r0 + n
    now = G[G_NOW]
    start = max(now, G[G_DEVFREE])
    end = start + cfg[C_STEP_BASE] + cfg[C_NS_TOK] * tokens + cfg[C_NS_KV] * kv_sum
    G[G_DEVFREE] = end
    plan_q, plan_n = _plan(G, cfg, seen, 1 if ng else 0, n)
    used = cfg[C_USABLE] - G[G_PLEN]
    srow = S[K[K_S]]
    srow[0], srow[1], srow[2], srow[3], srow[4] = k, t_sched, now, start, end
    srow[5], srow[6], srow[7], srow[8] = n, nc, ng, tokens
    srow[9], srow[10], srow[11] = plan_q, n, plan_n
    srow[12], srow[13], srow[14], srow[15], srow[16] = used, G[G_PLEN], 0, 0, -1
    srow[17] = spare
    K[K_S] += 1
    G[G_EVSTEP], G[G_EVPHASE] = k, 1
    G[G_STEP] = k + 1
    return r0, end


@nb.njit(cache=True)
def _process(G, K, E, D, V, W, R, T, run, pool, slots, cfg, bs, r0, n):  # type: ignore
    """Processor.process with overlap off: apply each row, finish, free."""
    k = W[r0, W_STEP]
    now = G[G_NOW]
    _emit(G, K, E, cfg, E_DONE, -1, -1, 0, k)
    for i in range(n):
        s, w = bs[i], W[r0 + i]
        if w[W_PHASE]:  # gen: one new token; the reservation already matches (no rewind)
            R[s, F_NHOST] += 1
        elif w[W_COMMIT] + w[W_Q] >= R[s, F_PREFILL]:
            R[s, F_NHOST] = R[s, F_PREFILL] + 1
            if R[s, F_FIRST] < 0:
                R[s, F_FIRST] = now
        else:
            continue
        if R[s, F_NHOST] >= R[s, F_LIM]:
            R[s, F_NHOST] = R[s, F_LIM]
            R[s, F_REASON] = 1 if R[s, F_LIM] == R[s, F_P] + R[s, F_O] else 2
            R[s, F_STATE], R[s, F_FIN] = S_FIN, now
            _free_blocks(G, K, E, cfg, pool, T, R, s)
            _run_remove(G, run, s)
            _done(K, D, R, s)
            slots[G[G_NSLOT]] = s
            G[G_NSLOT] += 1
        elif w[W_PHASE] and R[s, F_C] != R[s, F_NHOST] - 1:
            _violation(K, V, V_I18, k, R[s, F_RID], R[s, F_C], R[s, F_NHOST] - 1)
    G[G_PROCESSED] = k


@nb.njit(cache=True)
def loop(G, K, cfg, room, R, T, run, wait, pool, slots, flat, toks, seen, AR,
         S, W, PG, AL, TK, E, D, V):  # type: ignore[no-untyped-def]
    """Engine._loop (overlap off). Returns DONE, NEED_ARRIVALS or FLUSH (buffers nearly full:
    `room` holds the headroom one more iteration needs in each output buffer)."""
    maxb = cfg[C_MAXB]
    bs = np.empty(maxb + 1, np.int64)
    bstart = np.empty(maxb + 1, np.int64)
    bn = np.empty(maxb + 1, np.int64)
    caps = (S.shape[0], W.shape[0], PG.shape[0], AL.shape[0], TK.shape[0], E.shape[0],
            D.shape[0], V.shape[0])
    while True:
        for i in range(NK - 1):
            if K[i] + room[i] > caps[i]:
                return FLUSH
        if K[K_D] + G[G_AN] - G[G_AI] + room[K_D] > caps[K_D]:  # all pending may be rejected
            return FLUSH
        if G[G_MORE] and (G[G_AI] == G[G_AN] or AR[G[G_AN] - 1, 1] <= G[G_NOW]):
            return NEED_ARRIVALS  # the next arrival after now must be known (Engine.next_spec)
        _arrive(G, K, D, R, wait, slots, AR, cfg)
        t_sched = G[G_NOW]
        nc, ng = _schedule(G, K, E, R, T, run, wait, pool, cfg, bs, bstart, bn)
        _after_schedule(G, K, E, R, T, run, wait, pool, cfg)
        if nc + ng == 0:
            if G[G_AI] < G[G_AN]:
                G[G_NOW] = max(G[G_NOW], AR[G[G_AI], 1])
            elif G[G_NRUN] or G[G_WLEN]:
                if G[G_PLEN] != G[G_STALL]:
                    G[G_STALL] = G[G_PLEN]
                    continue
                head = wait[G[G_WHEAD]] if G[G_WLEN] else run[0]
                _violation(K, V, V_LIVENESS, G[G_STEP], R[head, F_RID], G[G_PLEN], 0)
                return DONE
            else:
                return DONE
            continue
        G[G_STALL] = -1
        G[G_NOW] += cfg[C_HOST_BASE] + cfg[C_HOST_ROW] * (nc + ng)
        r0, end = _launch(G, K, E, S, W, PG, AL, TK, R, T, flat, toks, seen, cfg, bs, bstart,
                          bn, nc, ng, t_sched)
        if end > G[G_NOW]:
            G[G_NOW] = end
        _process(G, K, E, D, V, W, R, T, run, pool, slots, cfg, bs, r0, nc + ng)
