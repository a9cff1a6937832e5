"""Block events against the holders model (Ownership.event / _apply / _release, compiled).

A block's holders are a linked list of request ids; only the multiset matters for what is
reported (the sole holder when there is one, membership, whether any holder is busy).
"""

from __future__ import annotations

from sim.check.compiled import codes as cd
from sim.check.compiled.common import emit, helper
from sim.check.compiled.content import content_event
from sim.check.compiled.inflight import mark_processing, using
from sim.check.compiled.state import C_NB, C_NULL, G_HFREE, G_HLIVE, G_RBASE, G_USED


@helper
def _push(own, b, req):  # type: ignore[no-untyped-def]
    g = own.g
    node = g[G_HFREE]
    g[G_HFREE] = own.hnext[node]
    g[G_HLIVE] += 1
    own.hreq[node], own.hnext[node] = req, own.hhead[b]
    own.hhead[b] = node
    own.refcount[b] += 1


@helper
def _free_node(own, node):  # type: ignore[no-untyped-def]
    g = own.g
    own.hnext[node] = g[G_HFREE]
    g[G_HFREE] = node
    g[G_HLIVE] -= 1


@helper
def _clear(own, b):  # type: ignore[no-untyped-def]
    node = own.hhead[b]
    while node != -1:
        nxt = own.hnext[node]
        _free_node(own, node)
        node = nxt
    own.hhead[b] = -1
    own.refcount[b] = 0


@helper
def _remove(own, b, req):  # type: ignore[no-untyped-def]
    """held.remove(req); False when req does not hold b."""
    prev, node = -1, own.hhead[b]
    while node != -1 and own.hreq[node] != req:
        prev, node = node, own.hnext[node]
    if node == -1:
        return False
    if prev == -1:
        own.hhead[b] = own.hnext[node]
    else:
        own.hnext[prev] = own.hnext[node]
    _free_node(own, node)
    own.refcount[b] -= 1
    return True


@helper
def sole(own, b):  # type: ignore[no-untyped-def]
    """Ownership.sole: the one holder, -1 when none or several."""
    return own.hreq[own.hhead[b]] if own.refcount[b] == 1 else -1


@helper
def _taken_code(own, b):  # type: ignore[no-untyped-def]
    """Ownership._taken_from's invariant: I17 when a holder has a step in flight."""
    node = own.hhead[b]
    while node != -1:
        if own.busy[own.hreq[node] - own.g[G_RBASE]] != 0:
            return cd.V_I17
        node = own.hnext[node]
    return cd.V_POOL


@helper
def block_event(own, slots, out, cfg, ev, i, alloc):  # type: ignore[no-untyped-def]
    """StepChecker.block_event for event i; `alloc`: the batch's alloc values (reach)."""
    code, b, step, req = ev.event[i], ev.block[i], ev.step[i], ev.request[i]
    if code == cd.DONE:
        mark_processing(own, ev.src[i])
        return
    content_event(slots, cfg, code, b, ev.src[i], ev.num_tokens[i])
    if not 0 <= b < cfg[C_NB]:
        emit(out, own.g, cd.V_POOL, step, req)
        return
    was = own.refcount[b]
    slots.whole[b] = -1  # its holders may change: the fast path must look again
    _apply(own, out, cfg, code, b, step, req, alloc)
    n = own.refcount[b]
    own.g[G_USED] += (n > 0) - (was > 0)
    if ev.refcount[i] != n:
        emit(out, own.g, cd.V_POOL, step, req)


@helper
def _apply(own, out, cfg, code, b, step, req, alloc):  # type: ignore[no-untyped-def]
    g = own.g
    if code == cd.ALLOC:
        if own.refcount[b] > 0:
            emit(out, g, _taken_code(own, b), step, req)
        if cfg[C_NULL] and b == 0:
            emit(out, g, cd.V_POOL, step, req)
        _clear(own, b)
        _push(own, b, req)
    elif code == cd.REUSE:
        _push(own, b, req)
    elif code == cd.EVICT:
        if own.refcount[b] > 0:
            emit(out, g, _taken_code(own, b), step, req)
    elif code == cd.FREE or code == cd.REWIND:
        if not _remove(own, b, req):
            emit(out, g, cd.V_I17 if code == cd.FREE else cd.V_POOL, step, req)
        elif using(own, alloc, req - g[G_RBASE], b, code == cd.FREE):
            emit(out, g, cd.V_I17, step, req)
