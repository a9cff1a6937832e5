"""Engine arithmetic pinned row by row: docs/design.md §3.4's worked examples, overlap offsets."""

from pathlib import Path

from sim.api import load_scenario, parse_scenario, run

ROOT = Path(__file__).resolve().parents[2]
COLS = ("step", "phase", "q_len", "pages", "kv_len", "append_pos", "cached_host", "kv_len_host",
        "committed", "alloc", "reserved", "accepted")


def rows_of(tmp_path, sc, profile):  # type: ignore[no-untyped-def]
    from sim.trace.reader import read_trace  # the logical rows (rows.parquet stores deltas)
    res = run(sc, out=tmp_path / "t", profile=profile)
    t = read_trace(tmp_path / "t").tables["rows"].to_pylist()
    return res, [tuple(r[c] for c in COLS) for r in t]


def example(overlap: bool, accepted=(1, 3, 0), extra: dict | None = None):  # type: ignore[no-untyped-def]
    d = {"seed": 0, "cache": {"tokens_per_block": 32, "num_blocks": 8, "reuse": "off"},
         "spec": {"mode": "mtp", "max_draft_len": 3,
                  "acceptance": {"kind": "forced", "accepted": list(accepted)}},
         "overlap": {"enabled": overlap},
         "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 58, "output_len": 8}]}}
    for k, v in (extra or {}).items():
        d[k] = {**d.get(k, {}), **v}
    return parse_scenario(d)


def test_worked_example_b_overlap_post_fix(tmp_path):
    res, rows = rows_of(tmp_path, example(True), "trtllm-post-17264")
    assert rows[:4] == [
        (0, "ctx", 58, [0, 1], 58, list(range(58)), 0, 58, 0, [0, 1], 58, -1),
        # gen1: prompt boundary, cached = P = 58, C = 62 fits in 2 blocks
        (1, "gen", 4, [0, 1], 62, [58, 59, 60, 61], 58, 62, 58, [0, 1], 62, 1),
        # gen2: host N=59 assumes all accepted (62/66); device committed 60, offset -2
        (2, "gen", 4, [0, 1, 2], 64, [60, 61, 62, 63], 62, 66, 60, [0, 1, 2], 66, 3),
        # gen3: host N=61 (64/68) equals the truth after a2 = 3; block 2 was rewound to the
        # free queue's front (TRT-LLM releaseLastBlock) and is the one taken again
        (3, "gen", 4, [0, 1, 2], 68, [64, 65, 66, 67], 64, 68, 64, [0, 1, 2], 68, 0),
    ]
    assert res.violations == []


def test_worked_example_b_pre_fix_first_generation_step_overreaches(tmp_path):
    res, rows = rows_of(tmp_path, example(True), "trtllm-pre-17264")
    # kv_len_host = N-1+2W = 65 -> 3 pages, only 2 allocated: the third id is stale (-1 here)
    assert rows[1] == (1, "gen", 4, [0, 1, -1], 65, [61, 62, 63, 64], 61, 65, 58, [0, 1], 62, 1)
    assert res.violations[0].invariant == "I12" and res.violations[0].step == 1


def test_worked_example_a_without_overlap(tmp_path):
    res, rows = rows_of(tmp_path, example(False), "trtllm-post-17264")
    assert [(r[0], r[5][0], r[4], r[8], r[10], len(r[9])) for r in rows[1:4]] == [
        (1, 58, 62, 58, 62, 2),  # gen1: C = 62
        (2, 60, 64, 60, 64, 2),  # a1 = 1: rewind 2 -> C = 60, +4 -> 64
        (3, 64, 68, 64, 68, 3),  # a2 = 3: C = 64, +4 -> 68 crosses into a third block
    ]
    assert res.violations == []


def test_example_c_shrinking_width_gives_a_positive_offset_that_reserved_pages_cover(tmp_path):
    # W=4 accepting all, then W=2: the device is 2 slots ahead of the host's estimate.
    sc = example(True, accepted=(3,), extra={"spec": {"runtime_draft_lens": [3, 1]},
                                             "cache": {"tokens_per_block": 16, "num_blocks": 16},
                                             "workload": {"requests": [
                                                 {"arrival_ns": 0, "prompt_len": 9,
                                                  "output_len": 24}]}})
    res, rows = rows_of(tmp_path, sc, "trtllm-post-17264")
    gen = [r for r in rows if r[1] == "gen"]
    offsets = [r[8] - r[6] for r in gen]  # committed - cached_host
    assert max(offsets) == 2
    assert res.violations == []
    bad = run(sc, profile="trtllm-post-17264+logical_width_table")
    assert bad.violations[0].invariant == "I2"


def test_reservation_arithmetic_i18_holds_on_a_long_mixed_run():
    sc, base = load_scenario(ROOT / "scenarios" / "mtp_rates.toml")
    res = run(sc, base_dir=base)
    assert res.violations == [] and res.summary["finished"] == res.summary["requests"]


def preempting():  # type: ignore[no-untyped-def]
    """24 MTP requests burst onto a 40-block pool under max-utilization: preemption happens."""
    return parse_scenario({
        "seed": 3, "cache": {"tokens_per_block": 16, "num_blocks": 40, "reuse": "off"},
        "scheduler": {"policy": "max-utilization", "max_batch_size": 16},
        "spec": {"mode": "mtp", "max_draft_len": 3,
                 "acceptance": {"kind": "rates", "rates": [0.8, 0.6, 0.4]}},
        "workload": {"synthetic": {"num_requests": 24, "arrival": "poisson", "qps": 500.0,
                                   "prompt_len": {"kind": "uniform", "min": 40, "max": 120},
                                   "output_len": {"kind": "uniform", "min": 40, "max": 120}}}})


def test_regression_max_utilization_preemption_does_not_livelock():
    """Found by the soak and the capacity sweeps: a failed reservation under max-utilization
    preempted the same (already pausing) victim forever. Now the row waits a step and the
    victim's blocks are released once nothing of it is in flight."""
    sc = preempting()
    res = run(sc)
    s = res.summary
    assert s["preemptions"] > 0 and s["finished"] == 24 and res.violations == []


def test_regression_a_request_at_the_position_limit_with_draft_kv_still_finishes():
    """Found by the fuzzer (tests/regressions): with spec.extra_kv_tokens, the draft clamp left
    no schedulable width one token before max_seq_len and the request was skipped forever
    (I17 never freed, LIVENESS). With no drafts left the draft layers write no extra KV."""
    sc = parse_scenario({
        "cache": {"tokens_per_block": 16, "num_blocks": 4, "reuse": "off"},
        "spec": {"mode": "mtp", "max_draft_len": 2, "extra_kv_tokens": 2,
                 "acceptance": {"kind": "forced", "accepted": [2]}},
        "model": {"max_position_embeddings": 31}, "limits": {"max_seq_len": 31},
        "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 16, "output_len": 15}]}})
    res = run(sc)
    assert res.violations == [] and res.summary["finished"] == 1


def test_draft_kv_needs_a_profile_whose_table_exposes_reserved_pages():
    import pytest

    from sim.errors import ProfileError
    sc = parse_scenario({
        "spec": {"mode": "mtp", "max_draft_len": 2, "extra_kv_tokens": 1},
        "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 8, "output_len": 4}]}})
    with pytest.raises(ProfileError, match="extra_kv_tokens = 1 needs a generation page table"):
        run(sc, profile="vllm-v1-legacy")


def test_regression_a_preemption_freed_in_flight_does_not_apply_stale_results():
    """Under free_in_flight, a preempted request is freed and requeued while a step of it is
    in flight; processing that step later applied its results to the new admission (KeyError in
    the KV manager). Those results now belong to the old admission and are dropped."""
    sc = preempting()
    res = run(sc, profile="trtllm-post-17264+free_in_flight")
    assert res.summary["finished"] == 24 and res.summary["preemptions"] > 0
    assert res.violations[0].invariant == "I17"
