"""StepChecker.launch, compiled: one step's checks, its appends, reads and rejected drafts,
then the violations in the oracle's order (LAUNCH_ORDER rank, then as each module emits)."""

from __future__ import annotations

from sim.check.compiled import codes as cd
from sim.check.compiled.common import emit, helper
from sim.check.compiled.content import apply_writes, reject_drafts
from sim.check.compiled.inflight import mark_launched
from sim.check.compiled.rows import (
    kernel_len,
    match_bit,
    page_bits,
    position_bits,
    size_bits,
    write_bits,
)
from sim.check.compiled.state import C_B, C_NB, C_NULL, C_PLAN_LIMIT, G_LAST, G_USED


@helper
def launch(own, slots, out, cfg, steps, i, lo, hi, rows, scratch):  # type: ignore[no-untyped-def]
    B = cfg[C_B]
    backend = steps.backend[i]
    csr, fa2, xqa = backend == cd.FA2 or backend == cd.FA3, backend == cd.FA2, backend == cd.XQA
    pb0 = rows.pages_off[lo] if hi > lo else 0
    ptotal = rows.pages_off[hi] - pb0 if hi > lo else 0
    flags, klen = scratch[0, :hi - lo], scratch[1, :hi - lo]  # per row; no NRT: no np.zeros
    for r in range(lo, hi):
        k = kernel_len(rows, r, fa2, B)
        klen[r - lo] = k
        flags[r - lo] = (size_bits(rows, r, k, csr, pb0, B) | position_bits(rows, r, k, B)
                         | write_bits(own, cfg, rows, r, csr, pb0, ptotal)
                         | match_bit(own, rows, r))
    # content.py's order: every row appends, then attention reads, then drafts are rejected;
    # the page checks share the reads' pass (appends change no block's holders)
    for r in range(lo, hi):
        apply_writes(slots, cfg, rows, r, csr, pb0, ptotal)
    for r in range(lo, hi):
        flags[r - lo] |= page_bits(own, slots, cfg, rows, r, klen[r - lo], csr, fa2, xqa, pb0,
                                   ptotal)
    for r in range(lo, hi):
        reject_drafts(slots, cfg, rows, r, csr, pb0, ptotal)
    step = steps.step[i]
    _plan_checks(own, out, cfg, steps, i, lo, hi, rows)
    _row_violations(own, out, step, lo, rows, flags)
    _pool_counts(own, out, cfg, steps, i)
    mark_launched(own, rows, step, lo, hi, B)
    own.g[G_LAST] = step


@helper
def _plan_checks(own, out, cfg, steps, i, lo, hi, rows):  # type: ignore[no-untyped-def]
    """I14 and I20 (sim/check/plans.py)."""
    g, step, n = own.g, steps.step[i], hi - lo
    plan_q = steps.plan_q_len[i]
    if plan_q != -1:
        for r in range(lo, hi):  # the decode plan serves the generation rows
            if rows.phase[r] == cd.GEN and rows.q_len[r] != plan_q:
                emit(out, g, cd.V_I14, step, rows.request[r])
                break
        if steps.plan_batch[i] != n:
            emit(out, g, cd.V_I14, step, -1)
    if steps.plan_cache_size[i] > cfg[C_PLAN_LIMIT]:
        emit(out, g, cd.V_I14, step, -1)
    if 0 < steps.graph_width[i] < n:
        emit(out, g, cd.V_I20, step, -1)


@helper
def _row_violations(own, out, step, lo, rows, flags):  # type: ignore[no-untyped-def]
    """Check by check (codes.R_* order), the flagged rows in batch order."""
    every = 0
    for f in flags:
        every |= f
    for k in range(cd.N_ROW_CHECKS):
        if every >> k & 1:
            for j in range(len(flags)):
                if flags[j] >> k & 1:
                    emit(out, own.g, k, step, rows.request[lo + j])


@helper
def _pool_counts(own, out, cfg, steps, i):  # type: ignore[no-untyped-def]
    """Ownership.pool_counts."""
    used, free = steps.blocks_used[i], steps.blocks_free[i]
    if used + free != cfg[C_NB] - cfg[C_NULL]:
        emit(out, own.g, cd.V_POOL, steps.step[i], -1)
    if used != own.g[G_USED]:
        emit(out, own.g, cd.V_POOL, steps.step[i], -1)
