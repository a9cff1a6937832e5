"""The fast engine's bookkeeping, compiled: the block pool (an LRU ring), block events,
request-slot lists and the records the loop emits. Each mirrors the reference function named in
its docstring (sim/kv/pool.py, sim/kv/manager.py, sim/kv/events.py, sim/executor/process.py)."""

from __future__ import annotations

import numba as nb

from sim.fast import fields as fl


@nb.njit(cache=True)
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@nb.njit(cache=True)
def _emit(G, K, E, cfg, ev, block, req, refcount, src):  # type: ignore[no-untyped-def]
    """EventLog.emit: the sequence number moves even when events are not recorded."""
    if cfg[fl.C_DETAIL]:
        i = K[fl.K_E]
        E[i, 0], E[i, 1], E[i, 2], E[i, 3] = G[fl.G_EVSTEP], G[fl.G_EVPHASE], G[fl.G_SEQ], ev
        E[i, 4], E[i, 5], E[i, 6], E[i, 7] = block, req, refcount, src
        K[fl.K_E] = i + 1
    G[fl.G_SEQ] += 1


@nb.njit(cache=True)
def _allocate(G, K, E, cfg, pool, T, R, s, n):  # type: ignore[no-untyped-def]
    """BlockPool.allocate + KVManager bookkeeping: n blocks from the LRU head onto slot s."""
    if n > G[fl.G_PLEN]:
        return False
    N = pool.shape[0]
    R[s, fl.F_TLOW] = min(R[s, fl.F_TLOW], R[s, fl.F_A])
    for _ in range(n):
        b = pool[G[fl.G_PHEAD]]
        G[fl.G_PHEAD] = (G[fl.G_PHEAD] + 1) % N
        G[fl.G_PLEN] -= 1
        _emit(G, K, E, cfg, fl.E_ALLOC, b, R[s, fl.F_RID], 1, -1)
        T[s, R[s, fl.F_A]] = b
        R[s, fl.F_A] += 1
    return True


@nb.njit(cache=True)
def _free_blocks(G, K, E, cfg, pool, T, R, s):  # type: ignore[no-untyped-def]
    """KVManager.free: every block back to the LRU tail, last block first."""
    N = pool.shape[0]
    for i in range(R[s, fl.F_A] - 1, -1, -1):
        pool[(G[fl.G_PHEAD] + G[fl.G_PLEN]) % N] = T[s, i]
        G[fl.G_PLEN] += 1
        _emit(G, K, E, cfg, fl.E_FREE, T[s, i], R[s, fl.F_RID], 0, -1)
    R[s, fl.F_A] = 0
    R[s, fl.F_C] = 0


@nb.njit(cache=True)
def _run_remove(G, run, s):  # type: ignore[no-untyped-def]
    n = G[fl.G_NRUN]
    j = 0
    while run[j] != s:
        j += 1
    run[j:n - 1] = run[j + 1:n]
    G[fl.G_NRUN] = n - 1


@nb.njit(cache=True)
def _done(K, D, R, s):  # type: ignore[no-untyped-def]
    """Processor._emit: the request record, in emission order (the requests table's order)."""
    i = K[fl.K_D]
    D[i, fl.D_RID], D[i, fl.D_ARR], D[i, fl.D_P] = R[s, fl.F_RID], R[s, fl.F_ARR], R[s, fl.F_P]
    D[i, fl.D_O], D[i, fl.D_TOK], D[i, fl.D_NHOST] = R[s, fl.F_O], R[s, fl.F_TOK], R[s, fl.F_NHOST]
    D[i, fl.D_FIRST], D[i, fl.D_FIN] = R[s, fl.F_FIRST], R[s, fl.F_FIN]
    D[i, fl.D_REASON], D[i, fl.D_NPRE] = R[s, fl.F_REASON], R[s, fl.F_NPRE]
    D[i, fl.D_GSTEPS] = R[s, fl.F_GSTEPS]
    K[fl.K_D] = i + 1


@nb.njit(cache=True)
def _violation(K, V, code, step, rid, x, y):  # type: ignore[no-untyped-def]
    i = K[fl.K_V]
    V[i, 0], V[i, 1], V[i, 2], V[i, 3], V[i, 4] = code, step, rid, x, y
    K[fl.K_V] = i + 1
