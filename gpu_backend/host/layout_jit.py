"""`layout.build_step`'s per-token and per-page work as one compiled (numba) pass.

Why: the numpy flattening is ~40 small array operations a step (~0.15 ms of host at batch 64
x kv 2k on a development machine, twice that on the H200's host), and the replay's host is its
bottleneck end to end (docs/gpu.md). One loop over the rows writes every array at
once. `layout.build_step` with `compiled=False` is the numpy oracle this is tested against
(tests/unit/test_flatten.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from gpu_backend.host import prepare_jit
from gpu_backend.host.prepare_jit import distinct, has
from sim.jit_cache import drop_stale

drop_stale(__file__)

import numba as nb  # noqa: E402


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
    return _flat(False, q_len, a_len, append_pos, rope_pos, tokens, committed, alloc,
                 alloc_len, lead, is_gen, new_tokens, indptr, ind, shared, B, guard, tail)


@nb.njit(cache=True)
def _flat(same: bool, q_len: np.ndarray, a_len: np.ndarray, append_pos: np.ndarray,
          rope_pos: np.ndarray, tokens: np.ndarray, committed: np.ndarray, alloc: np.ndarray,
          alloc_len: np.ndarray, lead: np.ndarray, is_gen: np.ndarray, new_tokens: np.ndarray,
          indptr: np.ndarray, ind: np.ndarray, shared: np.ndarray, B: int, guard: int, tail: int
          ) -> tuple[np.ndarray, ...]:
    """`layout_jit`; same: every row's appends are its queries, and the query tokens, app_row and
    app_rope come back empty (they are tokens, row_of_token and rope_pos: `run`)."""
    R = len(q_len)
    qo = np.zeros(R + 1, np.int32)
    for r in range(R):
        qo[r + 1] = qo[r] + q_len[r]
    nq, na = qo[R], a_len.sum()
    kv_indices = np.empty(len(ind) + tail, np.int32)
    _indices(ind, guard, kv_indices)
    o = _outputs(nq, na, same)
    n_mine, n_rej = rows(same, 0, R, 0, 0, 0, q_len, a_len, append_pos, rope_pos, tokens,
                         committed, alloc, alloc_len, lead, is_gen, new_tokens, indptr, ind,
                         shared, B, guard, len(ind) + tail, o[0], o[1], o[2], o[3], o[4], o[5],
                         o[6], o[7], o[8], o[9])
    return (qo, kv_indices, o[0], o[1], o[2], o[3], o[4], o[5], o[6],
            distinct(o[7][:n_mine]), o[8][:n_rej], o[9][:n_rej])


@nb.njit(cache=True)
def _outputs(nq: int, na: int, same: bool = False) -> tuple[np.ndarray, ...]:
    """`rows`' arrays for nq queries and na appends: row_of_token, true_pos, tokens of the
    queries; app_row, app_rope, engine_write, write_ok; their own pages, rejected pages and
    slots (room for one an append). same: the queries' tokens, app_row and app_rope empty."""
    nt, nr = (0, 0) if same else (nq, na)
    return (np.empty(nq, np.int32), np.empty(nq, np.int64), np.empty(nt, np.int64),
            np.empty(nr, np.int32), np.empty(nr, np.int64), np.empty(na, np.int64),
            np.zeros(na, np.bool_), np.empty(na, np.int64), np.empty(na, np.int64),
            np.empty(na, np.int64))


@nb.njit(cache=True, nogil=True)
def _indices(ind: np.ndarray, guard: int, out: np.ndarray) -> None:
    """out = ind + guard, and past len(ind) the left guard's last page (engine id -1: a tail
    entry)."""
    for i in range(len(ind)):
        out[i] = ind[i] + guard
    out[len(ind):] = guard - 1


@nb.njit(cache=True, nogil=True)
def rows(same: bool, r0: int, r1: int, q: int, a: int, p0: int, q_len: np.ndarray,
         a_len: np.ndarray, append_pos: np.ndarray, rope_pos: np.ndarray, tokens: np.ndarray,
         committed: np.ndarray, alloc: np.ndarray, alloc_len: np.ndarray, lead: np.ndarray,
         is_gen: np.ndarray, new_tokens: np.ndarray, indptr: np.ndarray, ind: np.ndarray,
         shared: np.ndarray, B: int, guard: int, n_ind: int, row_of_token: np.ndarray,
         true_pos: np.ndarray, tok_q: np.ndarray, app_row: np.ndarray, app_rope: np.ndarray,
         eng: np.ndarray, write_ok: np.ndarray, mine: np.ndarray, rej_page: np.ndarray,
         rej_slot: np.ndarray) -> tuple[int, int]:
    """`layout_jit`'s per-token arrays for rows r0..r1-1, whose first query is q, first append a,
    and whose truth blocks start at alloc[p0]. Their own pages and rejected slots (at most one
    an append) go to mine and rej_* from index a on: returns where each ends. Releases the
    GIL: `split` runs parts of a long step's rows on threads. same: every row's appends are its
    queries; tok_q, app_row and app_rope are left unwritten (they would be copies: `run`)."""
    # a page size of 2^sh divides by a shift (floor division and modulo alike, negatives too)
    sh = 0
    while (1 << sh) < B:
        sh += 1
    sh = sh if B == 1 << sh else -1
    m0 = n_mine = n_rej = a
    for r in range(r0, r1):
        _row_queries(same, r, q, a, q_len, a_len, append_pos, rope_pos, tokens, committed,
                     row_of_token, true_pos, tok_q, app_row, app_rope)
        q += q_len[r]
        a, n_mine, n_rej = _row_appends(r, a, p0, m0, n_mine, n_rej, a_len, append_pos,
                                        committed, alloc, alloc_len, lead, is_gen, new_tokens,
                                        indptr, ind, shared, B, sh, guard, n_ind, eng, write_ok,
                                        mine, rej_page, rej_slot)
        p0 += alloc_len[r]
    return n_mine, n_rej


@nb.njit(cache=True, nogil=True, inline="always")
def _row_queries(same: bool, r: int, q: int, a: int, q_len: np.ndarray, a_len: np.ndarray,
                 append_pos: np.ndarray, rope_pos: np.ndarray, tokens: np.ndarray,
                 committed: np.ndarray, row_of_token: np.ndarray, true_pos: np.ndarray,
                 tok_q: np.ndarray, app_row: np.ndarray, app_rope: np.ndarray) -> None:
    """`rows`' per-query arrays of row r (its first query q, first append a)."""
    ql, cm = q_len[r], committed[r]
    # a fill and a loop of its own each: written in one loop (a tuple store), they took 5x
    # as long at a 64 x 2k prompts' step (LLVM vectorizes these)
    row_of_token[q: q + ql] = r
    at = true_pos[q: q + ql]
    for j in range(ql):
        at[j] = cm + j
    if not same:
        tok_q[q: q + ql] = tokens[a: a + ql]
        for j in range(a_len[r]):
            app_row[a + j] = r
            app_rope[a + j] = rope_pos[q + j] if j < ql else append_pos[a + j]


@nb.njit(cache=True, nogil=True, inline="always")
def _row_appends(r: int, a: int, p0: int, m0: int, n_mine: int, n_rej: int,
                 a_len: np.ndarray, append_pos: np.ndarray, committed: np.ndarray,
                 alloc: np.ndarray, alloc_len: np.ndarray, lead: np.ndarray,
                 is_gen: np.ndarray, new_tokens: np.ndarray, indptr: np.ndarray,
                 ind: np.ndarray, shared: np.ndarray, B: int, sh: int, guard: int, n_ind: int,
                 eng: np.ndarray, write_ok: np.ndarray, mine: np.ndarray,
                 rej_page: np.ndarray, rej_slot: np.ndarray) -> tuple[int, int, int]:
    """`rows`' per-append arrays of row r (its first append a, its truth blocks from alloc[p0]):
    returns the next row's first append and where mine and rej_* end."""
    cm = committed[r]
    last = -1  # the truth's block of the last append: its page and checks hold for a run
    page, mine_ok = -1, False
    n, base = a_len[r], indptr[r]
    rej = new_tokens[r] if is_gen[r] else n  # its appends from here on are rejected drafts
    j = 0
    while j < n:
        # a run of appends at consecutive positions in one table entry and one truth block:
        # one engine page, one truth page, one verdict (a prompts' step's appends come in
        # runs of a page)
        ap, tp = append_pos[a], cm + j
        blk, slot = _div(tp, B, sh), _div(ap, B, sh)
        k = min(n - j, (slot + 1) * B - ap, (blk + 1) * B - tp)
        m = 1
        while m < k and append_pos[a + m] == ap + m:
            m += 1
        e = _engine(ind, base + slot, guard, n_ind)
        # the truth: true position committed + j lands in alloc[pos // B]
        if blk != last:  # once a page, not once a token
            last, page = blk, -1
            if blk < alloc_len[r] and len(alloc):
                page = alloc[min(p0 + blk, len(alloc) - 1)]
            page = page + guard if page >= 0 else -1
            mine_ok = page >= 0 and blk >= lead[r] and not has(shared, page - guard)
            # a page's tokens come in a run: the unique below sorts ~a page count
            if mine_ok and (n_mine == m0 or mine[n_mine - 1] != page):
                mine[n_mine] = page
                n_mine += 1
        ok = mine_ok and e == page
        if not ok and e >= 0:
            ok = _owns(alloc, p0, alloc_len[r], lead[r], shared, e - guard)
        eng[a: a + m] = e
        write_ok[a: a + m] = ok
        if page >= 0:
            for t in range(max(j, rej), j + m):
                rej_page[n_rej], rej_slot[n_rej] = page, cm + t - blk * B
                n_rej += 1
        a += m
        j += m
    return a, n_mine, n_rej


@nb.njit(cache=True, inline="always")
def _engine(ind: np.ndarray, s: int, guard: int, n_ind: int) -> int:
    """The pool page an engine's append through table entry s writes: indices[indptr[r] +
    pos // B], no bounds check (docs/design.md §3.5); a tail entry's is the left guard's last page;
    -1 outside the table and its tail."""
    if 0 <= s < len(ind) and ind[s] >= -guard:
        return ind[s] + guard
    if len(ind) <= s < n_ind:
        return guard - 1
    return -1


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


@nb.njit(cache=True)
def one_width(is_ctx: np.ndarray, q_len: np.ndarray) -> int:
    """The rows' one query width when they are all generation rows of one width (a steady
    step: one launch run, `batch._runs`), else -1 (or no rows). ~0.5 µs against numpy's ~8."""
    if not len(q_len):
        return -1
    w = q_len[0]
    for r in range(len(q_len)):
        if is_ctx[r] or q_len[r] != w:
            return -1
    return w


def run(*args: Any) -> tuple[np.ndarray, ...]:
    """`flatten(*args)`, or `split` across the host's threads for a long step
    (`prepare_jit.parts` of its appends)."""
    parts = prepare_jit.parts(len(args[2]))  # append_pos
    q_len, a_len, rope_pos, tokens = args[0], args[1], args[3], args[4]
    same = len(q_len) > 0 and tokens.dtype == rope_pos.dtype == np.int64 and \
        bool(np.array_equal(q_len, a_len))
    if not same:
        return split(parts, *args) if parts > 1 else flatten(*args)
    # every row's appends are its queries (a prompts' step): the queries' tokens, app_row and
    # app_rope are tokens, row_of_token and rope_pos, not copies written token by token (a
    # third of a 64 x 2k prompts' step's pass); `batch.bad_lengths` holds both to a
    # value a query
    f = split(parts, *args, same=True) if parts > 1 else _flat(True, *args)
    return (*f[:4], tokens, f[2], rope_pos, *f[7:])


def split(parts: int, q_len: np.ndarray, a_len: np.ndarray, append_pos: np.ndarray,
          rope_pos: np.ndarray, tokens: np.ndarray, committed: np.ndarray, alloc: np.ndarray,
          alloc_len: np.ndarray, lead: np.ndarray, is_gen: np.ndarray, new_tokens: np.ndarray,
          indptr: np.ndarray, ind: np.ndarray, shared: np.ndarray, B: int, guard: int,
          tail: int, *, same: bool = False) -> tuple[np.ndarray, ...]:
    """`layout_jit` with its rows in `parts` runs of about as many appends, one a thread
    (`prepare_jit`; `rows` releases the GIL), the kv indices on one more: the same arrays. For a
    long step, the prompts' step, whose preparation the device waits for: 128 x 2k's 262k
    appends took 1.64 against 2.26 ms on 8 threads of the H200's host.
    same: as `_flat`'s."""
    R = len(q_len)
    qo = np.zeros(R + 1, np.int32)
    qo[1:] = np.cumsum(q_len)
    a0 = np.zeros(R + 1, np.int64)
    a0[1:] = np.cumsum(a_len)
    p0 = np.zeros(R + 1, np.int64)
    p0[1:] = np.cumsum(alloc_len)
    nq, na, n_ind = int(qo[R]), int(a0[R]), len(ind) + tail
    kv_indices = np.empty(n_ind, np.int32)
    o = _outputs(nq, na, same)
    # rows [cut[i], cut[i + 1]): about na / parts appends each
    cut = np.unique(np.concatenate([[0], np.searchsorted(a0, np.arange(1, parts) * na // parts),
                                    [R]]))
    jobs: list[Callable[[], Any]] = [partial(_indices, ind, guard, kv_indices)]
    jobs += [partial(rows, same, int(r0), int(r1), int(qo[r0]), int(a0[r0]), int(p0[r0]), q_len,
                     a_len, append_pos, rope_pos, tokens, committed, alloc, alloc_len, lead,
                     is_gen, new_tokens, indptr, ind, shared, B, guard, n_ind, *o)
             for r0, r1 in zip(cut[:-1], cut[1:], strict=True)]
    done = list(prepare_jit.pool().map(lambda job: job(), jobs))[1:]
    runs = [(int(a0[r0]), m, j) for r0, (m, j) in zip(cut[:-1], done, strict=True)]
    mine = np.concatenate([o[7][a: m] for a, m, _ in runs]) if runs else o[7][:0]
    rej = [np.concatenate([x[a: j] for a, _, j in runs]) if runs else x[:0] for x in o[8:]]
    return (qo, kv_indices, *o[:7], distinct(mine), *rej)
