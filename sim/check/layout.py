"""Page-table layout invariants I2, I3, I4, I7, I13: is what the kernel is handed well formed?

    CSR:    kv_indices  [ r0 p0 p1 | r1 p0 p1 p2 | r2 p0 ]   kv_indptr = [0, 2, 5, 6]
                        '-- row r may index only [kv_indptr[r], kv_indptr[r] + nb_r) --'
"""

from __future__ import annotations

import numpy as np

from sim.check.access import CSR_BACKENDS, OUTSIDE_ROW
from sim.check.view import Model, StepView, ceil_div, first_in_row, row_violations, seg_max
from sim.trace.records import Violation


def check_layout(v: StepView, m: Model, refcount: np.ndarray) -> list[Violation]:
    out = i13_logical_width(v, m) + i2_table_covers(v, m) + i3_allocated(v, m, refcount)
    if v.backend in CSR_BACKENDS:
        out += i4_csr(v, m)
    return out + i7_own_range(v)


def i2_table_covers(v: StepView, m: Model) -> list[Violation]:
    cap = v.nb * m.B
    top = seg_max(v.lay.append_pos, v.lay.append_ptr)
    klen = v.acc.kernel_len
    out = row_violations("I2", v, top >= cap, lambda r: (
        f"append position {top[r]} is past the {v.nb[r]} exposed pages "
        f"({cap[r]} slots, B={m.B})"))
    return out + row_violations("I2", v, klen > cap, lambda r: (
        f"kernel kv_len {klen[r]} exceeds the {v.nb[r]} exposed pages ({cap[r]} slots, B={m.B})"))


def i3_allocated(v: StepView, m: Model, refcount: np.ndarray) -> list[Violation]:
    out: list[Violation] = []
    if v.backend in CSR_BACKENDS:
        out = row_violations("I3", v, v.nb > v.n_alloc, lambda r: (
            f"row exposes {v.nb[r]} pages but only {v.n_alloc[r]} blocks are allocated"))
        span = v.nb
    else:  # xqa reads only the columns its length covers; padding beyond is never read
        span = np.minimum(ceil_div(np.maximum(v.col["kv_len"], 0), m.B), v.nb)
    row = np.repeat(np.arange(v.n), v.nb)
    colx = np.arange(len(v.lay.pages)) - v.lay.pages_ptr[row]
    pg = v.lay.pages
    ok_id = (pg >= 0) & (pg < m.num_blocks)
    held = np.zeros(len(pg), bool)
    held[ok_id] = refcount[pg[ok_id]] > 0
    first = first_in_row((colx < span[row]) & ~held, row, v.n)
    return out + row_violations("I3", v, first >= 0, lambda r: (
        f"exposed page {pg[first[r]]} at ordinal {colx[first[r]]} is not allocated "
        f"(-1, out of range or refcount 0; exposed span {span[r]} pages)"))


def i4_csr(v: StepView, m: Model) -> list[Violation]:
    run = v.lay.pages_ptr[:-1]
    ind = v.col["kv_indptr"]
    out = row_violations("I4", v, ind != run, lambda r: (
        f"kv_indptr {ind[r]} != running sum of earlier rows' pages {run[r]}"))
    lpl = v.col["last_page_len"]
    out += row_violations("I4", v, (lpl < 1) | (lpl > m.B), lambda r: (
        f"last_page_len {lpl[r]} outside [1, {m.B}]"))
    pg = v.lay.pages
    row = np.repeat(np.arange(v.n), v.nb)
    bad = (pg < 0) | (pg >= m.num_blocks)
    first = first_in_row(bad, row, v.n)
    out += row_violations("I4", v, first >= 0, lambda r: (
        f"page id {pg[first[r]]} outside [0, {m.num_blocks})"))
    order = np.lexsort((pg, row))
    dup = np.zeros(len(pg), bool)
    dup[order[1:]] = (pg[order[1:]] == pg[order[:-1]]) & (row[order[1:]] == row[order[:-1]])
    first = first_in_row(dup, row, v.n)
    out += row_violations("I4", v, first >= 0, lambda r: f"page {pg[first[r]]} appears twice")
    if m.null_block:
        first = first_in_row(pg == 0, row, v.n)
        out += row_violations("I4", v, first >= 0, lambda r: "null block 0 is exposed")
    return out


def i7_own_range(v: StepView) -> list[Violation]:
    c, w = v.acc.read_chunks, v.acc.writes
    return (_outside(v, "reads", c.row, c.first, c.ordinal, c.page, c.flags)
            + _outside(v, "writes", w.row, w.pos, w.ordinal, w.page, w.flags))


def _outside(v: StepView, what: str, row: np.ndarray, pos: np.ndarray, ordinal: np.ndarray,
             page: np.ndarray, flags: np.ndarray) -> list[Violation]:
    first = first_in_row((flags & OUTSIDE_ROW) != 0, row, v.n)
    lo = v.col["kv_indptr"] if v.backend in CSR_BACKENDS else np.zeros(v.n, np.int64)
    unit = "ordinal" if v.backend in CSR_BACKENDS else "column"
    return row_violations("I7", v, first >= 0, lambda r: (
        f"kernel {what} position {pos[first[r]]} through {unit} {ordinal[first[r]]} "
        f"(page {page[first[r]]}) outside its own range [{lo[r]}, {lo[r] + v.nb[r]})"))


def i13_logical_width(v: StepView, m: Model) -> list[Violation]:
    if v.backend not in CSR_BACKENDS:
        return []  # a block-table kernel takes lengths separately: wider tables are safe
    logical = np.maximum(v.col["kv_len_host"], v.col["committed"] + v.col["q_len"])
    need = ceil_div(logical, m.B)
    klen = v.acc.kernel_len
    kneed = ceil_div(klen, m.B)
    out = row_violations("I13", v, v.nb > need, lambda r: (
        f"{v.backend} row exposes {v.nb[r]} pages but its logical length {logical[r]} needs "
        f"{need[r]} (B={m.B}): a CSR kernel would attend over the extra pages"))
    return out + row_violations("I13", v, (v.nb != kneed) & (v.nb <= need), lambda r: (
        f"{v.backend} row has {v.nb[r]} pages but kernel kv_len {klen[r]} spans {kneed[r]}"))
