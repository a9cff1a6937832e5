"""I8, I9, I11, I12, I16, I14, I20 and the docs/design.md §3.4 worked example."""

from __future__ import annotations

from test_check_support import Events, feed, gen, only, prefilled, step

from sim.check import INVARIANTS, StepChecker
from sim.trace.records import RowRecord


def test_i8_fa3_kernel_length_from_the_host_estimate() -> None:
    chk, _ev = prefilled("fa3")
    out = chk.launch(step(1, backend="fa3"), [gen(kv_len=7)])
    assert only(out, "I8") == ["I8 step 1 req 0: kernel kv_len 7 != committed 6 + q_len 2 = 8"]


def test_i9_append_and_rope_positions() -> None:
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa"), [gen(append_pos=(6, 8))])
    assert only(out, "I9") == ["I9 step 1 req 0: token 1: append_pos 8, rope_pos 7, expected "
                               "committed 6 + 1 = 7"]
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa"), [gen(rope_pos=(6,))])
    assert only(out, "I9") == ["I9 step 1 req 0: 2 append positions and 1 RoPE positions for "
                               "q_len 2"]


def test_i11_first_generation_step_must_use_the_prompt_boundary() -> None:
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa"), [gen(first_gen=True, prev_in_flight=True,
                                                  cached_host=7)])
    assert only(out, "I11") == ["I11 step 1 req 0: first generation step: cached_host 7 != "
                                "committed 6 (must use the prompt boundary)"]


def test_i11_overlap_offset_is_q_len_minus_previous_new_tokens() -> None:
    chk, _ev = prefilled("xqa")
    good = gen(prev_in_flight=True, prev_new_tokens=1, cached_host=7)  # host assumed 2, got 1
    assert chk.launch(step(1, backend="xqa"), [good]) == []
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa"), [gen(prev_in_flight=True, prev_new_tokens=1)])
    assert only(out, "I11") == ["I11 step 1 req 0: cached_host 6 - committed 6 = 0, expected "
                                "q_len 2 - prev_new_tokens 1 = 1"]


def test_i16_position_limit() -> None:
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa"), [gen(max_pos=7)])
    assert only(out, "I16") == ["I16 step 1 req 0: position 7 (append max 7, rope max 7, read "
                                "max 7) is not below the limit max_pos 7"]
    chk, _ev = prefilled("xqa")
    assert chk.launch(step(1, backend="xqa"), [gen(max_pos=8)]) == []


def test_i14_plan_width_batch_and_cache_bound() -> None:
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, backend="xqa", plan_q_len=1, plan_batch=2, plan_cache_size=65),
                     [gen()])
    assert only(out, "I14") == [
        "I14 step 1 req 0: plan built for q_len 1 used for a row of q_len 2",
        "I14 step 1: plan built for batch 2 used for 1 rows",
        "I14 step 1: plan cache holds 65 plans (bound 64: one per query width and one for "
        "prefill)"]
    chk, _ev = prefilled("xqa")
    assert chk.launch(step(1, backend="xqa", plan_q_len=2, plan_batch=1), [gen()]) == []


def test_i20_graph_width() -> None:
    chk, _ev = prefilled("xqa")
    out = chk.launch(step(1, rows=2, backend="xqa", graph_width=1),
                     [gen(), gen(row=1, request=0)])
    assert only(out, "I20") == ["I20 step 1: CUDA graph width 1 < 2 rows"]
    chk, _ev = prefilled("xqa")
    assert chk.launch(step(1, backend="xqa", graph_width=1), [gen()]) == []


def test_registry_names_every_implemented_invariant() -> None:
    assert {"I1", "I2", "I3", "I4", "I5", "I6", "I7", "I8", "I9", "I10", "I11", "I12", "I13",
            "I14", "I16", "I17", "I20", "POOL"} == set(INVARIANTS)


# -- docs/design.md §3.4 worked example: B=32, D=3, W=4, P=58, overlap ------------------------
WORLD = {"tokens_per_block": 32, "num_blocks": 8, "null_block": False}
P, W = 58, 4
CTX = RowRecord(step=0, row=0, request=0, phase="ctx", q_len=P, draft_len=0, first_gen=False,
                prev_in_flight=False, pages=(0, 1), kv_indptr=0, last_page_len=26, kv_len=P,
                append_pos=tuple(range(P)), rope_pos=tuple(range(P)), cached_host=0,
                kv_len_host=P, committed=0, alloc=(0, 1), reserved=P, shared_blocks=0,
                tokens=tuple(range(P)), accepted=-1, new_tokens=P, prev_new_tokens=-1,
                max_pos=4096)


def _first_gen(cached_host: int, kv_len_host: int) -> RowRecord:
    """Scheduled while the context forward is in flight: truth committed = P, reserved P + W."""
    return RowRecord(step=1, row=0, request=0, phase="gen", q_len=W, draft_len=W - 1,
                     first_gen=True, prev_in_flight=True, pages=(0, 1), kv_indptr=0,
                     last_page_len=30, kv_len=P + W, append_pos=tuple(range(P, P + W)),
                     rope_pos=tuple(range(P, P + W)), cached_host=cached_host,
                     kv_len_host=kv_len_host, committed=P, alloc=(0, 1), reserved=P + W,
                     shared_blocks=0, tokens=(1, 2, 3, 4), accepted=1, new_tokens=2,
                     prev_new_tokens=-1, max_pos=4096)


def _world() -> StepChecker:
    chk, ev = StepChecker(WORLD), Events()
    assert feed(chk, [ev(0, "alloc", 0, 0, 1), ev(0, "alloc", 1, 0, 1)]) == []
    assert chk.launch(step(0, backend="xqa", used=2, usable=8, processed_step=-1), [CTX]) == []
    return chk


def test_worked_example_pre_fix_first_gen_step_fires_i12() -> None:
    chk = _world()
    # host estimate: N = P known tokens, cached = N - 1 + W = 61, kv_len = N - 1 + 2W = 65
    out = chk.launch(step(1, backend="xqa", used=2, usable=8, processed_step=0),
                     [_first_gen(61, 65)])
    assert out[0].message == ("I12 step 1 req 0: host page-table row needs 3 blocks "
                              "(kv_len_host 65, B=32) but 2 are allocated")
    assert [v.invariant for v in out] == ["I12", "I11"]


def test_worked_example_post_fix_is_clean_through_gen2() -> None:
    chk, ev = _world(), Events()
    assert chk.launch(step(1, backend="xqa", used=2, usable=8, processed_step=0),
                      [_first_gen(P, P + W)]) == []
    # gen2: host N=59, cached 62, kv_len_host 66; first gen accepted 1 -> committed 60
    assert feed(chk, [ev(2, "alloc", 2, 0, 1)]) == []
    gen2 = RowRecord(step=2, row=0, request=0, phase="gen", q_len=W, draft_len=W - 1,
                     first_gen=False, prev_in_flight=True, pages=(0, 1, 2), kv_indptr=0,
                     last_page_len=32, kv_len=64, append_pos=(60, 61, 62, 63),
                     rope_pos=(60, 61, 62, 63), cached_host=62, kv_len_host=66, committed=60,
                     alloc=(0, 1, 2), reserved=66, shared_blocks=0, tokens=(5, 6, 7, 8),
                     accepted=3, new_tokens=4, prev_new_tokens=2, max_pos=4096)
    assert chk.launch(step(2, backend="xqa", used=3, usable=8, processed_step=1), [gen2]) == []
