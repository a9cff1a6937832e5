"""The kernels' access model (docs/design.md §3.5): exact (position, page, slot) lists."""

from __future__ import annotations

from dataclasses import replace

from test_check_support import ctx, gen

from sim.check.access import CLAMPED, INVALID, OUTSIDE_ROW, WILD, step_access

# two rows, B=4: row 0 = gen (pages 1, 2; kv_len 8), row 1 = ctx of req 1 (page 3; 2 tokens)
ROW1 = ctx(row=1, request=1, pages=(3,), alloc=(3,), kv_indptr=2, q_len=2, last_page_len=2,
           append_pos=(0, 1), rope_pos=(0, 1), kv_len=2, kv_len_host=2, tokens=(1, 2))


def test_fa2_reads_and_appends_of_well_formed_rows() -> None:
    a = step_access("fa2", [gen(), ROW1], 4, 16)
    assert a.kernel_len.tolist() == [8, 2]
    assert a.reads.of_row(0) == [(p, 1 + p // 4, p % 4) for p in range(8)]
    assert a.reads.of_row(1) == [(0, 3, 0), (1, 3, 1)]
    assert a.writes.of_row(0) == [(6, 2, 2), (7, 2, 3)]
    assert a.writes.of_row(1) == [(0, 3, 0), (1, 3, 1)]
    assert not a.reads.flags.any() and not a.writes.flags.any()


def test_fa2_over_long_row_reads_the_next_rows_pages() -> None:
    a = step_access("fa2", [gen(last_page_len=8), ROW1], 4, 16)  # (2-1)*4 + 8 = 12
    assert a.kernel_len.tolist() == [12, 2]
    assert a.reads.of_row(0)[8:] == [(8, 3, 0), (9, 3, 1), (10, 3, 2), (11, 3, 3)]
    assert a.reads.flagged(0, OUTSIDE_ROW) == [(8, 3, 0), (9, 3, 1), (10, 3, 2), (11, 3, 3)]
    assert a.reads.flagged(0, CLAMPED) == []


def test_fa2_clamps_to_page_0_slot_0_past_the_global_end() -> None:
    a = step_access("fa2", [replace(ROW1, kv_indptr=0),
                            gen(row=1, kv_indptr=1, last_page_len=8)], 4, 16)
    # row 1: pages (1, 2) at ordinals 1, 2 of a 3-entry flat array; length 12 -> ordinal 3 clamps
    assert a.reads.of_row(1)[8:] == [(8, 0, 0), (9, 0, 0), (10, 0, 0), (11, 0, 0)]
    assert a.reads.flagged(1, CLAMPED) == a.reads.of_row(1)[8:]
    assert a.reads.flagged(1, WILD) == []


def test_fa3_uses_host_length_and_reads_wild_past_the_flat_end() -> None:
    a = step_access("fa3", [gen(kv_len=10)], 4, 16)
    assert a.kernel_len.tolist() == [10]
    assert a.reads.of_row(0)[8:] == [(8, -1, 0), (9, -1, 1)]
    assert a.reads.flagged(0, WILD | INVALID) == [(8, -1, 0), (9, -1, 1)]


def test_xqa_reads_only_columns_below_the_length_and_wild_past_the_width() -> None:
    a = step_access("xqa", [gen(pages=(1, 2, -1, -1), kv_len=8)], 4, 16)
    assert [pg for _p, pg, _s in a.reads.of_row(0)] == [1] * 4 + [2] * 4  # padding never read
    a = step_access("xqa", [gen(pages=(1, 2), kv_len=9), ROW1], 4, 16)
    assert a.reads.of_row(0)[8:] == [(8, -1, 0)]
    assert a.reads.flagged(0, OUTSIDE_ROW | WILD) == [(8, -1, 0)]


def test_append_past_the_row_writes_the_next_row_or_wild() -> None:
    a = step_access("fa2", [gen(append_pos=(8, 9)), ROW1], 4, 16)
    assert a.writes.of_row(0) == [(8, 3, 0), (9, 3, 1)]  # into req 1's page: no bounds check
    assert a.writes.flagged(0, OUTSIDE_ROW) == [(8, 3, 0), (9, 3, 1)]
    a = step_access("fa2", [gen(append_pos=(8, 13))], 4, 16)
    assert a.writes.of_row(0) == [(8, -1, 0), (13, -1, 1)]
    assert a.writes.flagged(0, WILD) == [(8, -1, 0), (13, -1, 1)]
    a = step_access("xqa", [gen(pages=(1, 2, 5), append_pos=(8, 9))], 4, 16)
    assert a.writes.of_row(0) == [(8, 5, 0), (9, 5, 1)]


def test_invalid_page_ids_are_flagged() -> None:
    a = step_access("fa3", [gen(pages=(1, 99))], 4, 16)
    assert a.reads.flagged(0, INVALID) == [(p, 99, p % 4) for p in range(4, 8)]

