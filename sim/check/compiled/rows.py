"""One row's launch checks as bits (codes.R_*), compiled: layout.py, positions.py and the
row parts of ownership.py, and I10 through content.py here. Blocks' holders are as the step
found them (a launch changes none); slot content is after the step's appends (page_bits only).

`csr`: fa2/fa3 (pages are the row's slice of the flat kv_indices); `xqa`: the block table;
pb0: the step's first page in rows.pages, ptotal: the step's page count (len(lay.pages)).
"""

from __future__ import annotations

from sim.check.compiled import codes as cd
from sim.check.compiled.common import cdiv, helper
from sim.check.compiled.content import chunk_bad, read_page, rearm, write_page
from sim.check.compiled.pool import sole
from sim.check.compiled.state import C_B, C_NB, C_NULL, G_RBASE, G_STAMP


@helper
def kernel_len(rows, r, fa2, B):  # type: ignore[no-untyped-def]
    """access._kernel_len: FA2 derives it from the pages, the others take kv_len."""
    if not fa2:
        return max(rows.kv_len[r], 0)
    nb_ = rows.pages_off[r + 1] - rows.pages_off[r]
    return max((nb_ - 1) * B + rows.last_page_len[r], 0) if nb_ > 0 else 0


@helper
def size_bits(rows, r, klen, csr, pb0, B):  # type: ignore[no-untyped-def]
    """I12, I1, I13, I2 (kernel length), I3 (count), I4 (indptr, last_page_len), I7 reads."""
    nb_ = rows.pages_off[r + 1] - rows.pages_off[r]
    na = rows.alloc_off[r + 1] - rows.alloc_off[r]
    q, c, res = rows.q_len[r], rows.committed[r], rows.reserved[r]
    f = 0
    if cdiv(rows.kv_len_host[r], B) > na:
        f |= 1 << cd.R_I12
    if c + max(q, rows.app_off[r + 1] - rows.app_off[r]) > res:  # extra draft KV counts
        f |= 1 << cd.R_I1_REACH
    if cdiv(res, B) > na:
        f |= 1 << cd.R_I1_BLOCKS
    if csr:
        need = cdiv(max(rows.kv_len_host[r], c + q), B)
        if nb_ > need:
            f |= 1 << cd.R_I13_WIDE
        if nb_ != cdiv(klen, B) and nb_ <= need:
            f |= 1 << cd.R_I13_KLEN
        if nb_ > na:
            f |= 1 << cd.R_I3_COUNT
        if rows.kv_indptr[r] != rows.pages_off[r] - pb0:
            f |= 1 << cd.R_I4_INDPTR
        if rows.last_page_len[r] < 1 or rows.last_page_len[r] > B:
            f |= 1 << cd.R_I4_LPL
    if klen > nb_ * B:
        f |= 1 << cd.R_I2_KLEN
    if cdiv(klen, B) > nb_:  # a read chunk at a column past the row's own pages
        f |= 1 << cd.R_I7_READ
    return f


@helper
def position_bits(rows, r, klen, B):  # type: ignore[no-untyped-def]
    """I2 (append past the pages), I9, I8, I11, I16."""
    nb_ = rows.pages_off[r + 1] - rows.pages_off[r]
    q, c, gen = rows.q_len[r], rows.committed[r], rows.phase[r] == cd.GEN
    a0, n_app = rows.app_off[r], rows.app_off[r + 1] - rows.app_off[r]
    r0, n_rope = rows.rope_off[r], rows.rope_off[r + 1] - rows.rope_off[r]
    top_w = top_r = -1
    for j in range(n_app):
        top_w = max(top_w, rows.app[a0 + j])
    for j in range(n_rope):
        top_r = max(top_r, rows.rope[r0 + j])
    f = 0
    if top_w >= nb_ * B:
        f |= 1 << cd.R_I2_APPEND
    if n_app < q or n_rope != q or (not gen and n_app != q):
        f |= 1 << cd.R_I9_LEN
    else:
        for j in range(n_app):
            if rows.app[a0 + j] != c + j or (j < q and rows.rope[r0 + j] != c + j):
                f |= 1 << cd.R_I9_POS
                break
    if gen:
        f |= _gen_bits(rows, r, klen)
    if max(max(top_w, top_r), klen - 1) >= rows.max_pos[r]:
        f |= 1 << cd.R_I16
    return f


@helper
def _gen_bits(rows, r, klen):  # type: ignore[no-untyped-def]
    """I8 and I11 of a generation row."""
    q, c, host = rows.q_len[r], rows.committed[r], rows.cached_host[r]
    f = 0
    if klen != c + q:
        f |= 1 << cd.R_I8
    prev = rows.prev_new_tokens[r]
    if rows.first_gen[r] != 0:
        if host != c:
            f |= 1 << cd.R_I11_FIRST
    elif rows.prev_in_flight[r] != 0 and prev >= 0 and host - c != q - prev:
        f |= 1 << cd.R_I11_AHEAD
    return f


@helper
def page_bits(own, slots, cfg, rows, r, klen, csr, fa2, xqa, pb0, ptotal):  # type: ignore
    """I3 (span allocated), I4 (ids, repeats, null block), I5 (pages are the row's alloc) and
    I10 (attention reads), in one pass over the row's pages: run after the step's appends.

    The hot loop of the checker (one iteration per page id of the trace). Columns whose read
    chunk is whole and below `committed`, through the row's own page, take a fast path: page
    == alloc, in the pool and slots.whole[page] == col * B mean every check but I4's repeat
    test passes there (content.py says why); anything else goes through `_column`."""
    B, NB = cfg[C_B], cfg[C_NB]
    pages, alloc, whole, stamps = rows.pages, rows.alloc, slots.whole, own.stamp
    p0, nb_ = rows.pages_off[r], rows.pages_off[r + 1] - rows.pages_off[r]
    a0, na = rows.alloc_off[r], rows.alloc_off[r + 1] - rows.alloc_off[r]
    n_read = cdiv(klen, B)
    # reads go through the row's own pages (the usual case): no access model per chunk
    own_reads = not csr or rows.kv_indptr[r] == p0 - pb0
    fast = min(min(nb_, na), min(klen // B, rows.committed[r] // B)) if own_reads else 0
    own.g[G_STAMP] += 1
    stamp, null = own.g[G_STAMP], cfg[C_NULL] != 0
    f = invalid = 0
    bad = False  # I10
    for col in range(max(fast, 0)):
        p = pages[p0 + col]
        if p == alloc[a0 + col] and 0 <= p < NB and whole[p] == col * B:
            if csr:
                if stamps[p] == stamp:
                    f |= 1 << cd.R_I4_DUP
                stamps[p] = stamp
                if null and p == 0:
                    f |= 1 << cd.R_I4_NULL
        else:
            f, bad, invalid = _column(own, slots, cfg, rows, r, col, klen, csr, fa2, xqa,
                                      pb0, ptotal, own_reads, stamp, f, bad, invalid)
    for col in range(max(fast, 0), max(nb_, n_read)):
        f, bad, invalid = _column(own, slots, cfg, rows, r, col, klen, csr, fa2, xqa, pb0,
                                  ptotal, own_reads, stamp, f, bad, invalid)
    if invalid > 1 and _invalid_twice(rows, p0, nb_, NB):
        f |= 1 << cd.R_I4_DUP
    return f | (1 << cd.R_I10 if bad else 0)


@helper
def _column(own, slots, cfg, rows, r, col, klen, csr, fa2, xqa, pb0, ptotal, own_reads,  # type: ignore
            stamp, f, bad, invalid):
    """Every check of page_bits at one column, the general way (layout.py, ownership.py,
    content.py); returns the row's flags, I10 verdict and count of out-of-pool ids so far."""
    B, NB = cfg[C_B], cfg[C_NB]
    p0, nb_ = rows.pages_off[r], rows.pages_off[r + 1] - rows.pages_off[r]
    a0, na = rows.alloc_off[r], rows.alloc_off[r + 1] - rows.alloc_off[r]
    p = -1
    if col < nb_:
        p = rows.pages[p0 + col]
        mine = rows.alloc[a0 + col] if col < na else -2
        if p != mine and not (xqa and p == -1):  # xqa pads its table with -1
            f |= 1 << cd.R_I5_PAGES
        valid = 0 <= p < NB
        span = nb_ if csr else min(cdiv(max(rows.kv_len[r], 0), B), nb_)  # xqa: kv_len only
        if col < span and (not valid or own.refcount[p] == 0):
            f |= 1 << cd.R_I3_SPAN
        if csr and not valid:
            f |= 1 << cd.R_I4_RANGE
            invalid += 1
        elif csr:
            if own.stamp[p] == stamp:
                f |= 1 << cd.R_I4_DUP
            own.stamp[p] = stamp
            if cfg[C_NULL] and p == 0:
                f |= 1 << cd.R_I4_NULL
    if col < cdiv(klen, B) and not bad:
        page = p if own_reads and col < nb_ else read_page(rows, r, col, csr, fa2, pb0, ptotal)
        bad = chunk_bad(slots, rows, r, col, page, klen, B, NB)
        if 0 <= page < NB:
            rearm(slots, page, own.refcount[page] > 0, B)
    return f, bad, invalid


@helper
def _invalid_twice(rows, p0, n, NB):  # type: ignore[no-untyped-def]
    """A repeated out-of-pool id (rare: only a corrupt row has two): quadratic is fine."""
    for i in range(n):
        a = rows.pages[p0 + i]
        if 0 <= a < NB:
            continue
        for k in range(i + 1, n):
            if rows.pages[p0 + k] == a:
                return True
    return False


@helper
def write_bits(own, cfg, rows, r, csr, pb0, ptotal):  # type: ignore[no-untyped-def]
    """I7 (append outside the row), I5 (append target not exclusively the row's), I6 (append
    into a shared prefix block)."""
    B, NB = cfg[C_B], cfg[C_NB]
    nb_ = rows.pages_off[r + 1] - rows.pages_off[r]
    req, shared = rows.request[r], rows.shared_blocks[r]
    a0 = rows.app_off[r]
    f = 0
    for j in range(rows.app_off[r + 1] - a0):
        col = rows.app[a0 + j] // B
        if col < 0 or col >= nb_:
            f |= 1 << cd.R_I7_WRITE
        if 0 <= col < shared:
            f |= 1 << cd.R_I6_SHARED
        page = write_page(rows, r, col, csr, pb0, ptotal)
        if 0 <= page < NB and not (own.refcount[page] == 1 and sole(own, page) == req):
            f |= 1 << cd.R_I5_WRITES
    return f


@helper
def match_bit(own, rows, r):  # type: ignore[no-untyped-def]
    """Ownership.i6_match, row by row in batch order: the prefix match <= prompt - 1."""
    ri, c = rows.request[r] - own.g[G_RBASE], rows.committed[r]
    if rows.phase[r] == cd.CTX:  # the first chunk of an admission starts at the match
        if not own.match_has[ri]:
            own.match_has[ri], own.match_val[ri] = 1, c
        return 0
    if own.match_has[ri]:
        own.match_has[ri] = 0
        if own.match_val[ri] > c - 1:
            return 1 << cd.R_I6_MATCH
    return 0
