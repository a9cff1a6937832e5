"""I10, the slot-content model: unwritten, rejected and previous-owner slots are never read."""

from __future__ import annotations

from test_check_support import MODEL, Events, ctx, feed, gen, only, prefilled, step

from sim.check import StepChecker


def test_i10_reads_a_never_written_slot() -> None:
    chk, ev = StepChecker(MODEL), Events()
    feed(chk, [ev(0, "alloc", 1, 0, 1), ev(0, "alloc", 2, 0, 1)])
    chk.launch(step(0, backend="xqa"), [ctx(q_len=4, append_pos=(0, 1, 2, 3),
                                            rope_pos=(0, 1, 2, 3), tokens=(1, 2, 3, 4))])
    out = chk.launch(step(1, backend="xqa"), [gen()])  # claims 6 committed, only 4 written
    assert only(out, "I10") == ["I10 step 1 req 0: attention reads position 4 through page 2 "
                                "slot 0 (expected page 2), which holds never written since alloc "
                                "(and 1 more bad slots)"]


def test_i10_reads_a_rejected_draft() -> None:
    chk, _ev = prefilled("xqa")
    assert chk.launch(step(1, backend="xqa"), [gen(accepted=0)]) == []  # position 7 rejected
    # uncorrected overlap: the append lands one slot too far, attention covers position 7
    row = gen(step=2, committed=7, q_len=1, append_pos=(8,), rope_pos=(7,), kv_len=8,
              kv_len_host=8, cached_host=7, tokens=(9,), accepted=0)
    out = chk.launch(step(2, backend="xqa"), [row])
    assert only(out, "I10") == ["I10 step 2 req 0: attention reads position 7 through page 2 "
                                "slot 3 (expected page 2), which holds a rejected draft of req 0 "
                                "position 7"]
    assert "I9" in [v.invariant for v in out]


def test_i10_rejected_draft_rewritten_by_the_next_step_is_clean() -> None:
    chk, _ev = prefilled("xqa")
    assert chk.launch(step(1, backend="xqa"), [gen(accepted=0)]) == []
    row = gen(step=2, committed=7, q_len=1, append_pos=(7,), rope_pos=(7,), kv_len=8,
              kv_len_host=8, cached_host=7, tokens=(9,), accepted=0)
    assert chk.launch(step(2, backend="xqa"), [row]) == []


def test_i10_previous_owners_data_after_a_fresh_alloc() -> None:
    chk, ev = prefilled("xqa")
    feed(chk, [ev(0, "free", 2, 0, 0, phase="proc"), ev(0, "free", 1, 0, 0, phase="proc")])
    feed(chk, [ev(1, "alloc", 2, 1, 1), ev(1, "alloc", 1, 1, 1)])
    # req 1 claims 6 committed tokens in blocks (2, 1) that only req 0 ever wrote
    out = chk.launch(step(1, backend="xqa"), [gen(request=1, pages=(2, 1), alloc=(2, 1))])
    assert only(out, "I10")[0].startswith("I10 step 1 req 1: attention reads position 0 through "
                                          "page 2 slot 0 (expected page 2), which holds never "
                                          "written since alloc")


def test_i10_reuse_keeps_content_and_copy_copies_it() -> None:
    chk, ev = prefilled("xqa")  # req 0 wrote positions 0..5 into blocks (1, 2)
    feed(chk, [ev(1, "reuse", 1, 1, 2), ev(1, "alloc", 3, 1, 1),
               ev(1, "copy", 3, 1, 1, src=2, num_tokens=1)])
    # req 1: block 1 reused (0..3), block 3 a copy of position 4; it recomputes position 5
    c1 = ctx(step=1, request=1, committed=5, q_len=1, append_pos=(5,), rope_pos=(5,),
             tokens=(5,), pages=(1, 3), alloc=(1, 3), kv_len=6, kv_len_host=6,
             shared_blocks=1, reserved=6)
    assert chk.launch(step(1, backend="xqa", used=3), [c1]) == []


def test_i10_read_through_a_wrong_page() -> None:
    chk, ev = prefilled("fa2")
    feed(chk, [ev(1, "alloc", 3, 1, 1)])
    other = ctx(step=1, row=1, request=1, pages=(3,), alloc=(3,), kv_indptr=2, q_len=2,
                last_page_len=2, append_pos=(0, 1), rope_pos=(0, 1), kv_len=2,
                kv_len_host=2, reserved=4, tokens=(1, 2))
    out = chk.launch(step(1, rows=2, used=3), [gen(last_page_len=6), other])
    assert only(out, "I10") == ["I10 step 1 req 0: attention reads position 8 through page 3 "
                                "slot 0 (beyond the request's allocated blocks), which holds "
                                "req 1 position 0 (and 1 more bad slots)"]
