"""I10, the slot-content model (sim/check/content.py), compiled, with a per-page summary.

The oracle reads every slot a row attends to. Here each page keeps a summary of its slots:
run_len leading slots are WRITTEN at consecutive positions run_base, run_base + 1, ... A read
chunk (one page, `count` slots from position `first`, first a multiple of B) passes the
state/position test of content.py exactly when run_len >= count and run_base == first:

    if run_len >= count, every slot s < count holds position run_base + s == first + s;
    otherwise slot run_len is either not WRITTEN or breaks the run, so it fails that test
    (run_base != first fails it at slot 0, and run_len == 0 means slot 0 is not WRITTEN).

The summary is recomputed (O(B)) only for pages marked dirty since: written, copied into or
given rejected drafts; `alloc` resets it directly. The owner rule (the step's new positions
must be the row's own request) still reads those few slots one by one.

`whole[p]` condenses it further for rows/page_bits' fast path: it equals run_base only while
the page is clean, fully in one run (run_len == B) and held (refcount > 0), so one compare
`whole[p] == col * B` passes a whole chunk below `committed` in O(1). Anything that changes
the page's slots or holders sets it to -1 (no column starts there); the slow path re-arms it.
"""

from __future__ import annotations

from sim.check.compiled import codes as cd
from sim.check.compiled.common import helper
from sim.check.compiled.state import C_B, C_NB


@helper
def content_event(slots, cfg, code, b, src, num_tokens):  # type: ignore[no-untyped-def]
    """SlotModel.event: alloc forgets the block's content, copy clones a prefix of src."""
    B, NB = cfg[C_B], cfg[C_NB]
    if not 0 <= b < NB:
        return
    if code == cd.ALLOC:
        for k in range(b * B, (b + 1) * B):
            slots.state[k] = cd.UNWRITTEN
        slots.run_len[b], slots.dirty[b], slots.whole[b] = 0, 0, -1
    elif code == cd.COPY and 0 <= src < NB:
        n = min(num_tokens, B)
        if n > 0 and src != b:  # distinct pages: the slices never overlap
            d, s = b * B, src * B
            for k in range(n):  # a loop, not a slice copy: that may allocate (no NRT here)
                slots.state[d + k] = slots.state[s + k]
                slots.owner[d + k] = slots.owner[s + k]
                slots.pos[d + k] = slots.pos[s + k]
            changed(slots, b)


@helper
def changed(slots, p):  # type: ignore[no-untyped-def]
    """Page p's slots changed: its summary is stale."""
    slots.dirty[p], slots.whole[p] = 1, -1


@helper
def rearm(slots, p, held, B):  # type: ignore[no-untyped-def]
    """After a slow-path look at page p: may its whole chunks take the fast path again?"""
    if slots.dirty[p]:
        _fresh(slots, p, B)
    slots.whole[p] = slots.run_base[p] if held and slots.run_len[p] == B else -1


@helper
def _fresh(slots, p, B):  # type: ignore[no-untyped-def]
    """Recompute page p's run summary (its slots changed since)."""
    base, n = p * B, 0
    if slots.state[base] == cd.WRITTEN:
        start = slots.pos[base]
        while n < B and slots.state[base + n] == cd.WRITTEN and slots.pos[base + n] == start + n:
            n += 1
        slots.run_base[p] = start
    slots.run_len[p] = n
    slots.dirty[p] = 0


@helper
def write_page(rows, r, col, csr, pb0, ptotal):  # type: ignore[no-untyped-def]
    """access._page_of without the FA2 clamp: the page behind column `col` of row r, or -1
    (wild). pb0: the step's first page in rows.pages; ptotal: the step's page count."""
    nb_ = rows.pages_off[r + 1] - rows.pages_off[r]
    if csr:
        flat = rows.kv_indptr[r] + col
        inside = 0 <= flat < ptotal
    else:  # a block-table row is read only through its own columns
        flat = rows.pages_off[r] - pb0 + col
        inside = 0 <= flat < ptotal and 0 <= col < nb_
    return rows.pages[pb0 + flat] if inside else -1


@helper
def apply_writes(slots, cfg, rows, r, csr, pb0, ptotal):  # type: ignore[no-untyped-def]
    """The row's appends land: slot of position p holds (request, committed + j)."""
    B, NB = cfg[C_B], cfg[C_NB]
    c, req = rows.committed[r], rows.request[r]
    a0 = rows.app_off[r]
    for j in range(rows.app_off[r + 1] - a0):
        p = rows.app[a0 + j]
        page = write_page(rows, r, p // B, csr, pb0, ptotal)
        if 0 <= page < NB:
            i = page * B + p % B
            slots.state[i], slots.owner[i], slots.pos[i] = cd.WRITTEN, req, c + j
            changed(slots, page)


@helper
def reject_drafts(slots, cfg, rows, r, csr, pb0, ptotal):  # type: ignore[no-untyped-def]
    """After the reads: a gen row's appends past its accepted drafts stop being valid."""
    acc = rows.accepted[r]
    if rows.phase[r] != cd.GEN or acc < 0:
        return
    B, NB = cfg[C_B], cfg[C_NB]
    a0 = rows.app_off[r]
    for j in range(acc + 1, rows.app_off[r + 1] - a0):
        p = rows.app[a0 + j]
        page = write_page(rows, r, p // B, csr, pb0, ptotal)
        if 0 <= page < NB:
            slots.state[page * B + p % B] = cd.REJECTED
            changed(slots, page)


@helper
def read_page(rows, r, col, csr, fa2, pb0, ptotal):  # type: ignore[no-untyped-def]
    """The page a read of column `col` goes through; -1 where content.py's page_ok is False
    whatever the page: FA2 clamps an ordinal past the flat array to offset 0 (CLAMPED)."""
    if fa2 and rows.kv_indptr[r] + col >= ptotal:
        return -1
    return write_page(rows, r, col, csr, pb0, ptotal)


@helper
def chunk_bad(slots, rows, r, col, page, klen, B, NB):  # type: ignore[no-untyped-def]
    """SlotModel._check_reads for one read chunk (column col, through `page`): any bad slot?"""
    a0, na = rows.alloc_off[r], rows.alloc_off[r + 1] - rows.alloc_off[r]
    if col >= na or page != rows.alloc[a0 + col] or not 0 <= page < NB:
        return True  # not the request's block there (or beyond its allocation)
    return run_bad(slots, rows, r, page, col, klen, B)


@helper
def run_bad(slots, rows, r, page, col, klen, B):  # type: ignore[no-untyped-def]
    """The slots of read chunk `col` on the right page: the run summary, then the owner of
    this step's new positions."""
    first = col * B
    count = min(klen - first, B)
    if slots.dirty[page]:
        _fresh(slots, page, B)
    if slots.run_len[page] < count or slots.run_base[page] != first:
        return True
    return first + count > rows.committed[r] and _stray(slots, rows, r, page * B, first, count)


@helper
def _stray(slots, rows, r, base, first, count):  # type: ignore[no-untyped-def]
    """This step's new positions (>= committed) must hold the row's own request's K/V."""
    c, req = rows.committed[r], rows.request[r]
    for s in range(max(0, c - first), count):
        if slots.owner[base + s] != req:
            return True
    return False
