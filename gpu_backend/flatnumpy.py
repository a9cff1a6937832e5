"""`layout.build_step`'s per-token and per-page work in numpy: the definition the compiled pass
(`gpu_backend.flatten`) is held to (tests/unit/test_flatten.py), and `build_step(compiled=False)`.
"""

from __future__ import annotations

import numpy as np

from gpu_backend.intsets import member
from gpu_backend.layout import _FLAT, I32, TAIL, Columns, _ragged


def flat_numpy(c: Columns, indptr: np.ndarray, ind: np.ndarray, shared: np.ndarray,
                B: int, guard: int) -> dict[str, np.ndarray]:
    R = len(c["q_len"])
    q_len = c["q_len"]
    qo = np.concatenate([[0], np.cumsum(q_len)]).astype(I32)
    ind = np.concatenate([ind, np.full(TAIL, -1, dtype=np.int64)])
    row_of_token = np.repeat(np.arange(R), q_len).astype(I32)
    a_len = c["append_pos_len"]
    app_row, j_app = _ragged(a_len)
    app_row = app_row.astype(I32)
    app = c["append_pos"]
    # Append addresses indices[indptr[b] + pos // B] with no bounds check (docs/design.md §3.5).
    slot = indptr[app_row] + app // B
    inside = (slot >= 0) & (slot < len(ind))
    eng = np.where(inside, ind[np.clip(slot, 0, max(len(ind) - 1, 0))] if len(ind) else -1, -1)
    eng = np.where(inside & (eng >= -guard), eng + guard, -1).astype(np.int64)
    committed = c["committed"]
    true_pos = np.repeat(committed, q_len) + (np.arange(int(qo[-1])) - np.repeat(qo[:-1], q_len))
    allowed, write_ok, rej_p, rej_s = truth_writes(
        c, B, guard, app_row, np.repeat(committed, a_len) + j_app, eng, shared)
    # a row's first q_len appends are its queries; K of the extra (device-ahead) appends is
    # built at their append position
    is_q = j_app < q_len[app_row]
    app_rope = app.copy()
    app_rope[is_q] = c["rope_pos"]
    out = (qo, (ind + guard).astype(I32), row_of_token, true_pos, c["tokens"][is_q], app_row,
           app_rope, eng, write_ok, allowed, rej_p, rej_s)
    return dict(zip(_FLAT, out, strict=True))


def truth_writes(c: Columns, B: int, guard: int, row_of_token: np.ndarray,
                  true_pos: np.ndarray, eng: np.ndarray,
                  shared: np.ndarray) -> tuple[np.ndarray, ...]:
    """(allowed pages, write_ok per token, rejected-draft pages, slots), all from the truth:
    token t of row r writes true position committed_r + j into alloc_r[pos // B]; the row may
    write that block unless it is one of its shared prefix blocks."""
    n_alloc, alloc = c["alloc_len"], c["alloc"]
    ptr = np.concatenate([[0], np.cumsum(n_alloc)])
    lead = c["shared_blocks"]
    blk = true_pos // B
    has = blk < n_alloc[row_of_token]
    page = np.where(has, alloc[np.minimum(ptr[row_of_token] + blk, max(len(alloc) - 1, 0))]
                    if len(alloc) else -1, -1)
    page = np.where(page >= 0, page + guard, -1)
    mine = (page >= 0) & (blk >= lead[row_of_token]) & ~np.isin(page - guard, shared)
    # pages of each row's own non-shared blocks, keyed by row: may the engine's write go there?
    # (the definition, over every page of the batch: this is the compiled pass's oracle)
    own_row = np.repeat(np.arange(len(n_alloc)), n_alloc)
    own_ok = (np.arange(len(alloc)) - ptr[own_row] >= lead[own_row]) & (alloc >= 0)
    own_ok &= ~np.isin(alloc, shared)
    big = 1 << 32
    own_keys = np.sort(own_row[own_ok] * big + alloc[own_ok] + guard)
    write_ok = member(row_of_token.astype(np.int64) * big + eng, own_keys) & (eng >= 0)
    gen = c["is_gen"][row_of_token]
    new = c["new_tokens"][row_of_token]
    committed = c["committed"][row_of_token]
    rej = gen & (true_pos - committed >= new) & (page >= 0)
    return (np.unique(page[mine]), write_ok, page[rej], true_pos[rej] % B)
