"""I2, I3, I4, I7, I13: each fires with its exact message, and the clean row stays clean."""

from __future__ import annotations

from test_check_support import ctx, feed, gen, only, prefilled, step


def test_default_gen_row_is_clean_on_every_backend() -> None:
    for backend in ("fa2", "fa3", "xqa"):
        chk, _ev = prefilled(backend)
        assert chk.launch(step(1, backend=backend), [gen()]) == []


def test_i2_append_past_the_exposed_pages() -> None:
    chk, ev = prefilled("xqa")
    feed(chk, [ev(1, "alloc", 3, 0, 1)])
    # logical-width table (2 pages) while the device reaches position 8 (reserved page 3 exists)
    row = gen(q_len=3, append_pos=(6, 7, 8), rope_pos=(6, 7, 8), kv_len=9, kv_len_host=9,
              alloc=(1, 2, 3), reserved=12, tokens=(1, 2, 3), accepted=2)
    out = chk.launch(step(1, backend="xqa", used=3), [row])
    assert only(out, "I2") == [
        "I2 step 1 req 0: append position 8 is past the 2 exposed pages (8 slots, B=4)",
        "I2 step 1 req 0: kernel kv_len 9 exceeds the 2 exposed pages (8 slots, B=4)"]
    assert out[0].invariant == "I2"


def test_i2_clean_with_the_reserved_width_table() -> None:
    chk, ev = prefilled("xqa")
    feed(chk, [ev(1, "alloc", 3, 0, 1)])
    row = gen(q_len=3, append_pos=(6, 7, 8), rope_pos=(6, 7, 8), kv_len=9, kv_len_host=9,
              pages=(1, 2, 3), alloc=(1, 2, 3), reserved=12, tokens=(1, 2, 3), accepted=2)
    assert chk.launch(step(1, backend="xqa", used=3), [row]) == []


def test_i3_csr_row_wider_than_the_allocation() -> None:
    chk, _ev = prefilled("fa3")
    out = chk.launch(step(1, backend="fa3"), [gen(pages=(1, 2, 7))])
    assert only(out, "I3") == [
        "I3 step 1 req 0: row exposes 3 pages but only 2 blocks are allocated",
        "I3 step 1 req 0: exposed page 7 at ordinal 2 is not allocated "
        "(-1, out of range or refcount 0; exposed span 3 pages)"]


def test_i3_xqa_unallocated_entry_inside_the_span_but_not_in_padding() -> None:
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa"), [gen(pages=(1, -1, -1))])
    assert only(out, "I3") == [
        "I3 step 1 req 0: exposed page -1 at ordinal 1 is not allocated "
        "(-1, out of range or refcount 0; exposed span 2 pages)"]
    chk, _ev = prefilled("xqa")
    assert chk.launch(step(1, backend="xqa"), [gen(pages=(1, 2, -1, -1))]) == []


def test_i4_csr_structure() -> None:
    chk, _ev = prefilled("fa3")
    out = chk.launch(step(1, backend="fa3"), [gen(kv_indptr=1, last_page_len=0)])
    assert only(out, "I4") == [
        "I4 step 1 req 0: kv_indptr 1 != running sum of earlier rows' pages 0",
        "I4 step 1 req 0: last_page_len 0 outside [1, 4]"]
    chk, _ev = prefilled("fa3")
    out = chk.launch(step(1, backend="fa3"), [gen(pages=(1, 99))])
    assert only(out, "I4") == ["I4 step 1 req 0: page id 99 outside [0, 16)"]
    chk, _ev = prefilled("fa3")
    out = chk.launch(step(1, backend="fa3"), [gen(pages=(2, 2))])
    assert only(out, "I4") == ["I4 step 1 req 0: page 2 appears twice"]


def test_i4_null_block_exposed() -> None:
    from test_check_support import MODEL
    model = dict(MODEL, null_block=True)
    chk, ev = prefilled("fa3", model)
    feed(chk, [ev(1, "alloc", 3, 1, 1)])
    row = ctx(step=1, row=1, request=1, pages=(0,), alloc=(3,), kv_indptr=2, q_len=2,
              append_pos=(0, 1), rope_pos=(0, 1), kv_len=2, kv_len_host=2, tokens=(1, 2))
    out = chk.launch(step(1, rows=2, backend="fa3", used=3, usable=15), [gen(), row])
    assert only(out, "I4") == ["I4 step 1 req 1: null block 0 is exposed"]


def test_i7_fa2_over_long_row_reads_the_next_rows_pages() -> None:
    chk, ev = prefilled("fa2")
    feed(chk, [ev(1, "alloc", 3, 1, 1)])
    # last_page_len 8 > B: FA2 derives kv_len 12 and walks into row 1's page 3
    other = ctx(step=1, row=1, request=1, pages=(3,), alloc=(3,), kv_indptr=2, q_len=2,
                last_page_len=2, append_pos=(0, 1), rope_pos=(0, 1), kv_len=2,
                kv_len_host=2, reserved=4, tokens=(1, 2))
    out = chk.launch(step(1, rows=2, used=3), [gen(last_page_len=8), other])
    assert only(out, "I7") == [
        "I7 step 1 req 0: kernel reads position 8 through ordinal 2 (page 3) outside its own "
        "range [0, 2)"]


def test_i7_clean_for_two_well_formed_rows() -> None:
    chk, ev = prefilled("fa2")
    feed(chk, [ev(1, "alloc", 3, 1, 1)])
    other = ctx(step=1, row=1, request=1, pages=(3,), alloc=(3,), kv_indptr=2, q_len=2,
                last_page_len=2, append_pos=(0, 1), rope_pos=(0, 1), kv_len=2,
                kv_len_host=2, reserved=4, tokens=(1, 2))
    assert chk.launch(step(1, rows=2, used=3), [gen(), other]) == []


def test_i13_reservation_width_table_on_fa2() -> None:
    chk, ev = prefilled("fa2")
    feed(chk, [ev(1, "alloc", 3, 0, 1)])
    row = gen(pages=(1, 2, 3), alloc=(1, 2, 3), reserved=12)
    out = chk.launch(step(1, used=3), [row])
    assert out[0].message == (
        "I13 step 1 req 0: fa2 row exposes 3 pages but its logical length 8 needs 2 (B=4): "
        "a CSR kernel would attend over the extra pages")
    # the same table on the block-table kernel is fine
    chk, ev = prefilled("xqa")
    feed(chk, [ev(1, "alloc", 3, 0, 1)])
    assert chk.launch(step(1, backend="xqa", used=3), [row]) == []


def test_i13_fa3_length_spans_fewer_pages() -> None:
    chk, _ev = prefilled("fa3")
    out = chk.launch(step(1, backend="fa3"), [gen(kv_len=4, kv_len_host=4, q_len=2)])
    assert only(out, "I13") == ["I13 step 1 req 0: fa3 row has 2 pages but kernel kv_len 4 "
                                "spans 1"]
