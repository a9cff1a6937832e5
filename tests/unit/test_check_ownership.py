"""I1, I5, I6, I17 and POOL: each fires with its exact message; clean counterparts stay clean."""

from __future__ import annotations

from test_check_support import ctx, feed, gen, only, prefilled, step


def test_i1_reservation_does_not_cover_the_step() -> None:
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa"), [gen(reserved=7)])
    assert only(out, "I1") == ["I1 step 1 req 0: reservation C=7 does not cover committed 6 + "
                               "2 written = 8"]
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa"), [gen(reserved=9)])
    assert only(out, "I1") == ["I1 step 1 req 0: reserved 9 slots need 3 blocks (B=4) but 2 "
                               "are allocated"]


def test_i5_page_of_another_request() -> None:
    chk, ev = prefilled("xqa")
    feed(chk, [ev(1, "alloc", 3, 1, 1)])
    out = chk.launch(step(1, backend="xqa", used=3), [gen(pages=(1, 3))])
    assert only(out, "I5")[0] == ("I5 step 1 req 0: page 3 at ordinal 1 is not the request's "
                                  "block there (alloc [1, 2])")


def test_i5_append_into_a_block_someone_else_also_holds() -> None:
    chk, ev = prefilled("xqa")
    feed(chk, [ev(1, "reuse", 2, 1, 2)])  # partial reuse without copy by req 1
    out = chk.launch(step(1, backend="xqa"), [gen()])
    assert only(out, "I5") == ["I5 step 1 req 0: appends position 6 into page 2 slot 2, which "
                               "is not exclusively its own (holders [0, 1], refcount 2)"]


def test_i6_append_into_a_shared_prefix_block() -> None:
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa"), [gen(shared_blocks=2)])
    assert only(out, "I6") == ["I6 step 1 req 0: appends position 6 into shared read-only block "
                               "ordinal 1 (page 2; shared_blocks 2)"]
    chk, _ev = prefilled("xqa")
    assert chk.launch(step(1, backend="xqa"), [gen(shared_blocks=1)]) == []


def test_i6_reuse_match_covering_the_whole_prompt() -> None:
    chk, ev = prefilled("xqa")  # req 0 prefilled by step 0
    feed(chk, [ev(1, "reuse", 1, 1, 2), ev(1, "reuse", 2, 1, 2)])  # req 1 matches all 8 tokens
    # ... and its context row starts at committed 8: nothing left to recompute
    c1 = ctx(step=1, request=1, committed=8, q_len=0, append_pos=(), rope_pos=(), tokens=(),
             kv_len=8, kv_len_host=8, last_page_len=4, reserved=8, shared_blocks=2)
    chk.launch(step(1, backend="xqa"), [c1])
    g1 = gen(step=2, request=1, committed=8, alloc=(1, 2), reserved=8, shared_blocks=2,
             first_gen=True, cached_host=8)
    out = chk.launch(step(2, backend="xqa"), [g1])
    assert only(out, "I6")[-1] == ("I6 step 2 req 1: reuse matched 8 tokens of a 8-token prompt "
                                   "(at most 7: the last prompt token is recomputed)")


def test_i17_free_while_a_step_using_the_request_is_in_flight() -> None:
    chk, ev = prefilled("xqa")
    # overlap: step 1 is launched and processes step 0; req 0 freed although step 1 uses it
    chk.launch(step(1, backend="xqa"), [gen()])
    feed(chk, [ev(1, "done", -1, -1, 0, phase="proc", src=0)])
    out = feed(chk, [ev(1, "free", 2, 0, 0, phase="proc")])
    assert [v.message for v in out] == ["I17 step 1 req 0: free of block 2 while step 1 using "
                                        "req 0 is in flight"]


def test_i17_free_after_processing_is_clean() -> None:
    chk, ev = prefilled("xqa")
    chk.launch(step(1, backend="xqa"), [gen()])
    feed(chk, [ev(1, "done", -1, -1, 0, phase="proc", src=1)])
    assert feed(chk, [ev(1, "free", 2, 0, 0, phase="proc"),
                      ev(1, "free", 1, 0, 0, phase="proc")]) == []
    assert chk.finish() == []


def test_i17_double_free() -> None:
    chk, ev = prefilled("xqa")
    feed(chk, [ev(1, "free", 2, 0, 0), ev(1, "free", 1, 0, 0)])
    out = feed(chk, [ev(1, "free", 2, 0, 0)])
    assert [v.message for v in out] == ["I17 step 1 req 0: free of block 2 that req 0 does not "
                                        "hold (holders []): freed twice?"]


def test_i17_block_reassigned_while_its_holder_is_in_flight() -> None:
    chk, ev = prefilled("xqa")
    chk.launch(step(1, backend="xqa"), [gen()])
    feed(chk, [ev(1, "done", -1, -1, 0, phase="proc", src=0)])
    out = feed(chk, [ev(2, "alloc", 2, 1, 1)])
    assert out[0].message == ("I17 step 2 req 1: block 2 allocated to req 1 while held by "
                              "requests [0] (refcount 1); req 0 has a step in flight")


def test_i17_rewind_of_a_block_an_in_flight_row_uses() -> None:
    chk, ev = prefilled("xqa")
    chk.launch(step(1, backend="xqa"), [gen()])
    feed(chk, [ev(1, "done", -1, -1, 0, phase="proc", src=0)])
    out = feed(chk, [ev(1, "rewind", 2, 0, 0, phase="proc")])
    assert [v.message for v in out] == ["I17 step 1 req 0: rewind of block 2 while step 1 using "
                                        "req 0 is in flight"]


def test_i17_and_pool_at_finish_never_freed() -> None:
    chk, _ev = prefilled("xqa")
    assert [v.message for v in chk.finish()] == [
        "I17 step 0 req 0: never freed: still holds blocks [1, 2]",
        "POOL step 0: pool not idle at end of run: 2 blocks still held"]


def test_pool_refcount_mismatch_and_alloc_of_a_held_block() -> None:
    chk, ev = prefilled("xqa")
    out = feed(chk, [ev(1, "reuse", 1, 1, 3)])
    assert [v.message for v in out] == ["POOL step 1 req 1: reuse of block 1 records refcount 3 "
                                        "but 2 live requests hold it [0, 1]"]
    out = feed(chk, [ev(1, "alloc", 2, 1, 1)])
    assert [v.message for v in out] == ["POOL step 1 req 1: block 2 allocated to req 1 while "
                                        "held by requests [0] (refcount 1)"]


def test_pool_step_counts() -> None:
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa", used=3, usable=16), [gen()])
    assert [v.message for v in out] == [
        "POOL step 1: blocks_used 3 but block events leave 2 blocks held"]
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa", used=2, usable=15), [gen()])
    assert [v.message for v in out] == ["POOL step 1: blocks_used 2 + blocks_free 13 != 16"]
