"""`layout.build_step`'s per-token and per-page work as one compiled (numba) pass.

Why: the numpy flattening is ~40 small array operations a step (~0.15 ms of host at batch 64
x kv 2k on a development machine, twice that on the H200's host), and the replay's host is its
bottleneck end to end (docs/gpu.md, round 12). One loop over the rows writes every array at
once. `layout.build_step` with `compiled=False` is the numpy oracle this is tested against
(tests/unit/test_flatten.py).
"""

from __future__ import annotations

import numpy as np

from sim.jit_cache import drop_stale

drop_stale(__file__)  # before the kernels below load anything from numba's cache

import numba as nb  # noqa: E402

from gpu_backend.prepk import distinct, has  # noqa: E402


@nb.njit(cache=True)
def flatten(q_len: np.ndarray, a_len: np.ndarray, append_pos: np.ndarray,
            rope_pos: np.ndarray, tokens: np.ndarray, committed: np.ndarray,
            alloc: np.ndarray, alloc_len: np.ndarray, lead: np.ndarray, is_gen: np.ndarray,
            new_tokens: np.ndarray, indptr: np.ndarray, ind: np.ndarray, shared: np.ndarray,
            B: int, guard: int, tail: int) -> tuple[np.ndarray, ...]:
    """The rows' flat arrays (layout.StepBatch's names): qo_indptr, kv_indices (pool indices,
    `tail` poison entries past the end), row_of_token, true_pos, tokens of the queries,
    app_row, app_rope, engine_write, write_ok, allowed_pages, reject_page, reject_slot.
    `ind`/`indptr`: the engine's flat table (engine ids) and row offsets; `shared`: sorted engine
    ids of blocks with more than one holder. Same rules as the numpy path, see there."""
    R = len(q_len)
    nq, na, n_ind = q_len.sum(), a_len.sum(), len(ind) + tail
    qo = np.zeros(R + 1, np.int32)
    kv_indices = np.empty(n_ind, np.int32)
    for i in range(len(ind)):
        kv_indices[i] = ind[i] + guard
    kv_indices[len(ind):] = guard - 1  # engine id -1: the last left guard page
    row_of_token, true_pos = np.empty(nq, np.int32), np.empty(nq, np.int64)
    tok_q = np.empty(nq, np.int64)
    app_row, app_rope = np.empty(na, np.int32), np.empty(na, np.int64)
    eng, write_ok = np.empty(na, np.int64), np.zeros(na, np.bool_)
    mine = np.empty(na, np.int64)
    rej_page, rej_slot = np.empty(na, np.int64), np.empty(na, np.int64)
    # a page size of 2^sh divides by a shift (floor division and modulo alike, negatives too)
    sh = 0
    while (1 << sh) < B:
        sh += 1
    sh = sh if B == 1 << sh else -1
    n_mine = n_rej = q = a = p0 = 0
    for r in range(R):
        ql, cm = q_len[r], committed[r]
        qo[r + 1] = qo[r] + ql
        for j in range(ql):
            row_of_token[q + j], true_pos[q + j] = r, cm + j
            tok_q[q + j] = tokens[a + j]
        q += ql
        last = -1  # the truth's block of the last append: its page and checks hold for a run
        page, mine_ok = -1, False
        for j in range(a_len[r]):
            app_row[a] = r
            app_rope[a] = rope_pos[q - ql + j] if j < ql else append_pos[a]
            # the engine's append: indices[indptr[r] + pos // B], no bounds check (reference §3)
            s = indptr[r] + _div(append_pos[a], B, sh)
            e = -1  # outside the table and its tail
            if 0 <= s < len(ind) and ind[s] >= -guard:
                e = ind[s] + guard
            elif len(ind) <= s < n_ind:
                e = guard - 1  # a tail entry
            eng[a] = e
            # the truth: true position committed + j lands in alloc[pos // B]
            tp = cm + j
            blk = _div(tp, B, sh)
            if blk != last:  # once a page, not once a token (0.62x this pass at 128 x 8k)
                last, page = blk, -1
                if blk < alloc_len[r] and len(alloc):
                    page = alloc[min(p0 + blk, len(alloc) - 1)]
                page = page + guard if page >= 0 else -1
                mine_ok = page >= 0 and blk >= lead[r] and not has(shared, page - guard)
                # a page's tokens come in a run: the unique below sorts ~a page count
                if mine_ok and (n_mine == 0 or mine[n_mine - 1] != page):
                    mine[n_mine] = page
                    n_mine += 1
            write_ok[a] = mine_ok and e == page
            if not write_ok[a] and e >= 0:
                write_ok[a] = _owns(alloc, p0, alloc_len[r], lead[r], shared, e - guard)
            if is_gen[r] and j >= new_tokens[r] and page >= 0:
                rej_page[n_rej], rej_slot[n_rej] = page, tp - _div(tp, B, sh) * B
                n_rej += 1
            a += 1
        p0 += alloc_len[r]
    return (qo, kv_indices, row_of_token, true_pos, tok_q, app_row, app_rope, eng, write_ok,
            distinct(mine[:n_mine]), rej_page[:n_rej], rej_slot[:n_rej])


@nb.njit(cache=True, inline="always")
def _div(x: int, B: int, sh: int) -> int:
    """x // B (floor), by a shift where B == 2^sh (sh >= 0): an int64 division is ~40 cycles."""
    return x >> sh if sh >= 0 else x // B


@nb.njit(cache=True)
def _owns(alloc: np.ndarray, p0: int, n: int, lead: int, shared: np.ndarray, page: int
          ) -> bool:
    """Is engine page `page` one of the row's own blocks (alloc[p0 + lead: p0 + n], allocated,
    not shared)? Only asked for a write that misses the page the truth names."""
    for i in range(lead, n):
        x = alloc[p0 + i]
        if x == page and x >= 0 and not has(shared, x):
            return True
    return False
