"""Workload config, explicit and synthetic sources: exact seeded values and the structure the
simulator relies on (arrival order, shared prefixes, chat turns containing the previous turn)."""

import tomllib
import tracemalloc

import numpy as np
import pytest
from pydantic import ValidationError

from sim.errors import KvsimError
from sim.workload import (
    RequestSpec,
    WorkloadConfig,
    WorkloadError,
    build_workload,
    iter_workload,
)
from sim.workload.content import CHUNK_UNITS


def synthetic(**kw) -> WorkloadConfig:
    base = {"num_requests": 4, "qps": 10.0, "vocab_size": 50,
            "prompt_len": {"kind": "uniform", "min": 2, "max": 5},
            "output_len": {"kind": "uniform", "min": 1, "max": 9}}
    return WorkloadConfig.model_validate({"synthetic": base | kw})


def build(cfg: WorkloadConfig, seed: int = 7, block: int = 4) -> list[RequestSpec]:
    return build_workload(cfg, np.random.default_rng(seed), tokens_per_block=block)


def explicit(*reqs: dict, **kw) -> WorkloadConfig:
    return WorkloadConfig.model_validate({"requests": list(reqs)} | kw)


def same(a: list[RequestSpec], b: list[RequestSpec]) -> bool:
    def key(r: RequestSpec) -> tuple:
        return r.rid, r.arrival_ns, r.prompt.tolist(), r.output_len, r.session
    return [key(r) for r in a] == [key(r) for r in b]


# ---- config -------------------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    {},
    {"requests": [{"arrival_ns": 0, "prompt_len": 1, "output_len": 1}],
     "trace": {"path": "x.csv", "format": "azure2023"}},
])
def test_exactly_one_source(data):
    with pytest.raises(ValidationError, match="exactly one of workload.requests, "
                                              "workload.synthetic, workload.trace"):
        WorkloadConfig.model_validate(data)


@pytest.mark.parametrize("req, fragment", [
    ({"arrival_ns": 0, "output_len": 1}, "give exactly one of prompt_len, prompt_tokens"),
    ({"arrival_ns": 0, "output_len": 1, "prompt_len": 2, "prompt_tokens": [1]},
     "give exactly one of prompt_len, prompt_tokens"),
    ({"arrival_ns": 0, "output_len": 1, "prompt_tokens": [1], "prefix_group": 0},
     "prefix_group needs prompt_len"),
    ({"arrival_ns": -1, "output_len": 1, "prompt_len": 1}, "greater than or equal to 0"),
    ({"arrival_ns": 0, "output_len": 0, "prompt_len": 1}, "greater than or equal to 1"),
    ({"arrival_ns": 0, "output_len": 1, "prompt_tokens": [-1]}, "greater than or equal to 0"),
    ({"arrival_ns": 0, "output_len": 1, "prompt_len": 1, "colour": 3}, "Extra inputs"),
])
def test_explicit_request_validation(req, fragment):
    with pytest.raises(ValidationError, match=fragment):
        explicit(req)


def test_prefix_group_needs_prefix_len():
    with pytest.raises(ValidationError, match="workload.prefix_len is required"):
        explicit({"arrival_ns": 0, "output_len": 1, "prompt_len": 3, "prefix_group": 0})


def test_explicit_only_knobs_are_rejected_elsewhere():
    with pytest.raises(ValidationError, match="workload.vocab_size applies only to "
                                              "workload.requests"):
        WorkloadConfig.model_validate({"synthetic": synthetic().synthetic.model_dump(),
                                       "vocab_size": 10})


@pytest.mark.parametrize("kw, fragment", [
    ({"arrival": "gamma"}, "cv is required when arrival = 'gamma'"),
    ({"cv": 2.0}, "cv applies only to arrival = 'gamma'"),
    ({"qps": 0}, "greater than 0"),
    ({"num_requests": 0}, "greater than or equal to 1"),
    ({"prompt_len": {"kind": "uniform", "min": 5, "max": 4}}, r"min \(5\) must be <= max \(4\)"),
    ({"prompt_len": {"kind": "lognormal", "mean": 9, "sigma": 1, "min": 9, "max": 3}},
     r"min \(9\) must be <= max \(3\)"),
    ({"prompt_len": {"kind": "zipf", "value": 3}}, "does not match any of the expected tags"),
    ({"shared_prefix": {"groups": 1000, "prefix_len": 1_000_000}},
     "groups \\* prefix_len must be <= 100000000"),
    ({"vocab_size": 1}, "greater than or equal to 2"),
])
def test_synthetic_validation(kw, fragment):
    with pytest.raises(ValidationError, match=fragment):
        synthetic(**kw)


def test_toml_sections_parse():
    text = """
    [workload.synthetic]
    num_requests = 3
    arrival = "gamma"
    cv = 2.0
    qps = 1.5
    prompt_len = { kind = "lognormal", mean = 100, sigma = 0.5, min = 8, max = 400 }
    output_len = { kind = "constant", value = 16 }
    shared_prefix = { groups = 2, prefix_len = 32, fraction = 0.5 }
    sessions = { num_turns = 3, think_ns = 2_000_000_000 }
    """
    cfg = WorkloadConfig.model_validate(tomllib.loads(text)["workload"])
    assert len(build(cfg)) == 3
    text = """
    [[workload.requests]]
    arrival_ns = 0
    prompt_len = 58
    output_len = 8
    """
    assert len(build(WorkloadConfig.model_validate(tomllib.loads(text)["workload"]))) == 1


@pytest.mark.parametrize("data", [
    {"synthetic": synthetic().synthetic.model_dump()},
    {"trace": {"path": "t.csv", "format": "azure2023", "fallback": synthetic().synthetic}},
    {"requests": [{"arrival_ns": 0, "prompt_len": 3, "output_len": 1, "prefix_group": 0}],
     "prefix_len": 2, "vocab_size": 9},
])
def test_dumped_config_validates_again(data):
    cfg = WorkloadConfig.model_validate(data)
    assert WorkloadConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_workload_error_is_a_user_error():
    assert issubclass(WorkloadError, KvsimError) and issubclass(WorkloadError, ValueError)


def test_bad_tokens_per_block():
    with pytest.raises(WorkloadError, match="tokens_per_block must be >= 1, got 0"):
        build(synthetic(), block=0)


# ---- explicit -----------------------------------------------------------------------------

def test_explicit_exact_values_order_and_shared_prefix():
    cfg = explicit(
        {"arrival_ns": 5, "prompt_len": 4, "output_len": 2, "prefix_group": 1},
        {"arrival_ns": 0, "prompt_tokens": [7, 8], "output_len": 1, "session": 3},
        {"arrival_ns": 5, "prompt_len": 2, "output_len": 3, "prefix_group": 1},
        {"arrival_ns": 1, "prompt_len": 3, "output_len": 3},
        vocab_size=10, prefix_len=3)
    got = [(r.rid, r.arrival_ns, r.prompt.tolist(), r.output_len, r.session)
           for r in build(cfg, seed=1)]
    # Draws: prefix of group 1 [4, 5, 7]; then input order: [9, 0, 1, 8] (its head replaced
    # by the prefix), [9, 2] (likewise, the prefix cut to P = 2), [3, 8, 4].
    # Ties at 5 ns keep input order.
    assert got == [(0, 0, [7, 8], 1, 3), (1, 1, [3, 8, 4], 3, -1),
                   (2, 5, [4, 5, 7, 8], 2, -1), (3, 5, [4, 5], 3, -1)]


def test_explicit_prompts_are_read_only_int32():
    r = build(explicit({"arrival_ns": 0, "prompt_tokens": [1, 2], "output_len": 1}))[0]
    assert r.prompt.dtype == np.int32
    with pytest.raises(ValueError, match="read-only"):
        r.prompt[0] = 5


# ---- synthetic ----------------------------------------------------------------------------

def test_synthetic_exact_values():
    got = build(synthetic())
    assert [r.rid for r in got] == [0, 1, 2, 3]
    assert [r.arrival_ns for r in got] == [0, 70752926, 173273261, 230128127]
    assert [r.output_len for r in got] == [3, 8, 9, 1]
    assert [r.prompt.tolist() for r in got] == [[39, 42, 49, 4, 4], [1, 9], [41, 4],
                                                [3, 44, 49]]
    assert all(r.session == -1 and r.prompt.dtype == np.int32 for r in got)


def test_same_seed_same_workload_other_seed_other_workload():
    cfg = synthetic(num_requests=300, shared_prefix={"groups": 3, "prefix_len": 4,
                                                     "fraction": 0.5})
    assert same(build(cfg, seed=3), build(cfg, seed=3))
    assert not same(build(cfg, seed=3), build(cfg, seed=4))


def test_content_does_not_depend_on_block_size():
    cfg = synthetic(num_requests=50)
    assert same(build(cfg, block=1), build(cfg, block=64))


def test_iter_equals_build_across_chunks():
    cfg = synthetic(num_requests=2 * CHUNK_UNITS + 17, sessions={"num_turns": 3, "think_ns": 10})
    rng = np.random.default_rng(5)
    assert same(list(iter_workload(cfg, rng, tokens_per_block=4)), build(cfg, seed=5))


def test_poisson_rate_and_ordering():
    got = build(synthetic(num_requests=100_000, qps=250.0))
    t = np.array([r.arrival_ns for r in got])
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    rate = (len(t) - 1) / (t[-1] / 1e9)
    assert rate == pytest.approx(250.0, rel=0.02)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)


def test_gamma_rate_and_burstiness():
    got = build(synthetic(num_requests=100_000, qps=50.0, arrival="gamma", cv=3.0))
    gaps = np.diff([r.arrival_ns for r in got])
    assert 1e9 / gaps.mean() == pytest.approx(50.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)


def test_length_distributions():
    got = build(synthetic(num_requests=50_000,
                          prompt_len={"kind": "lognormal", "mean": 300, "sigma": 0.5,
                                      "min": 1, "max": 100_000},
                          output_len={"kind": "constant", "value": 7}))
    p = np.array([len(r.prompt) for r in got])
    assert p.mean() == pytest.approx(300, rel=0.02)
    assert {r.output_len for r in got} == {7}
    clamped = build(synthetic(num_requests=2000, prompt_len={
        "kind": "lognormal", "mean": 300, "sigma": 1.0, "min": 100, "max": 400}))
    p = np.array([len(r.prompt) for r in clamped])
    assert p.min() == 100 and p.max() == 400


def test_tokens_within_vocab():
    got = build(synthetic(num_requests=200, vocab_size=3))
    assert {int(t) for r in got for t in r.prompt} == {0, 1, 2}


def test_shared_prefixes_are_really_shared():
    cfg = synthetic(num_requests=400, vocab_size=1000,
                    prompt_len={"kind": "uniform", "min": 2, "max": 40},
                    shared_prefix={"groups": 2, "prefix_len": 16, "fraction": 0.5})
    got = build(cfg)
    long = [r.prompt for r in got if len(r.prompt) >= 16]
    heads = {tuple(p[:16].tolist()) for p in long}
    shared = [h for h in heads if sum(tuple(p[:16].tolist()) == h for p in long) > 1]
    assert len(shared) == 2  # both groups used, everything else unique
    members = sum(tuple(p[:16].tolist()) in shared for p in long)
    assert members / len(long) == pytest.approx(0.5, abs=0.08)
    # A prompt shorter than the prefix is the prefix cut to its length.
    short = [r.prompt for r in got if len(r.prompt) < 16]
    assert any(np.array_equal(p, np.array(shared[0][: len(p)])) for p in short)


def test_sessions_turns_contain_previous_turn():
    cfg = synthetic(num_requests=5, sessions={"num_turns": 2, "think_ns": 50_000_000})
    got = [(r.rid, r.arrival_ns, r.session, r.output_len, r.prompt.tolist()) for r in build(cfg)]
    assert got == [
        (0, 0, 0, 3, [39, 42, 49, 4]),
        (1, 50000000, 0, 3, [39, 42, 49, 4, 4, 1, 9, 41, 4, 3, 44, 49]),
        (2, 141505851, 1, 8, [5, 2, 1, 33, 37]),
        (3, 191505851, 1, 9, [5, 2, 1, 33, 37, 19, 0, 19, 11, 29, 46, 23, 19, 9, 47]),
        (4, 346546521, 2, 1, [1, 35]),  # the last session is cut short by num_requests
    ]


def test_sessions_structure_at_scale():
    cfg = synthetic(num_requests=3000, qps=100.0, sessions={"num_turns": 4, "think_ns": 10**8},
                    shared_prefix={"groups": 1, "prefix_len": 3})
    got = build(cfg)
    assert [r.rid for r in got] == list(range(3000))
    assert all(a.arrival_ns <= b.arrival_ns for a, b in zip(got, got[1:], strict=False))
    by_session: dict[int, list[RequestSpec]] = {}
    for r in got:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 750
    for turns in by_session.values():
        assert len(turns) == 4
        assert {b.arrival_ns - a.arrival_ns for a, b in zip(turns, turns[1:], strict=False)} \
            == {10**8}
        for a, b in zip(turns, turns[1:], strict=False):
            # previous prompt, then a stand-in for its output, then >= 2 new user tokens
            assert len(b.prompt) >= len(a.prompt) + a.output_len + 2
            assert np.array_equal(b.prompt[: len(a.prompt)], a.prompt)
    assert len({tuple(r.prompt[:3].tolist()) for r in got if len(r.prompt) >= 3}) == 1


def test_iterating_keeps_memory_bounded():
    cfg = synthetic(num_requests=100_000, prompt_len={"kind": "constant", "value": 200})
    # 80 MB of prompts in all; iterating without keeping them stays within a few chunks.
    tracemalloc.start()
    try:
        for _ in iter_workload(cfg, np.random.default_rng(0), tokens_per_block=16):
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 25e6, peak
