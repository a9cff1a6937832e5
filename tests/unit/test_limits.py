"""The limits on user input (sim/inputs.py, the schemas' bounds and cross-field checks, the CLI
options' ranges), each at its boundary: the last value allowed passes, the next is refused."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from sim.cli.options import MAX_WORKERS, OptionError, check_seconds, check_workers
from sim.config import parse_scenario
from sim.errors import ScenarioError
from sim.inputs import MAX_DEPTH, check_tree, load_json, load_toml, read_input, shown
from sim.sweep.spec import MAX_GRID_POINTS, SweepSpec
from sim.workload.config import MAX_WORKLOAD_TOKENS, ConstantLength, Sessions, SyntheticConfig
from sim.workload.readers import parse_mooncake
from sim.workload.spec import WorkloadError
from sim.workload.synthetic import draw_arrivals, plan_synthetic
from tests.hardening.corpus import BASE, _set


# -- sim/inputs.py ------------------------------------------------------------------------------
def test_a_fifo_is_refused_without_opening_it(tmp_path) -> None:
    fifo = tmp_path / "s.toml"
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(_error(read_input, fifo, "scenario", 99)))
    t.start()
    t.join(5)  # opening a FIFO for reading blocks until a writer comes: it must not be opened
    assert done == [f"{fifo}: scenario: must be a regular file (got a FIFO)"]


def test_devices_and_folders_are_refused(tmp_path) -> None:
    assert _error(read_input, "/dev/zero", "scenario", 99) == \
        "/dev/zero: scenario: must be a regular file (got a device)"
    assert _error(read_input, tmp_path, "sweep", 99) == \
        f"{tmp_path}: sweep: must be a regular file (got a directory)"


def test_size_cap_is_inclusive(tmp_path) -> None:
    f = tmp_path / "x.toml"
    f.write_bytes(b"a" * 10)
    assert read_input(f, "scenario", 10) == b"a" * 10
    assert _error(read_input, f, "scenario", 9) == \
        f"{f}: scenario: size: at most 9 bytes (got 10 or more)"


def test_nesting_depth_boundary() -> None:
    ok: object = 1
    for _ in range(MAX_DEPTH):
        ok = [ok]
    check_tree(ok, "f")
    assert _error(check_tree, {"a": ok}, "f").startswith("f: a.0.0.0")


def test_huge_integer_is_named_by_field(tmp_path) -> None:
    f = tmp_path / "s.toml"
    f.write_text("[cache]\nnum_blocks = " + "9" * 5000 + "\n")
    assert _error(load_toml, f, "scenario", 2**20) == \
        f"{f}: cache.num_blocks: an integer of at most 64 bits (got an integer of 16610 bits)"
    f.write_text("seed = 1\nbad = " + "9" * 30000 + "\n")
    assert _error(load_toml, f, "scenario", 2**20).startswith(f"{f}: line 2 (bad): ")


def test_deep_toml_names_the_line(tmp_path) -> None:
    f = tmp_path / "s.toml"
    f.write_text("seed = 1\nx = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert _error(load_toml, f, "scenario", 2**20) == \
        f"{f}: line 2 (x): nesting: at most {MAX_DEPTH} tables and arrays deep (got deeper)"


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_json_non_finite_is_named(tmp_path, token) -> None:
    f = tmp_path / "c.json"
    f.write_text('{"gemm": [{"us": ' + token + "}]}")
    assert _error(load_json, f, "calibration", 2**20).startswith(f"{f}: gemm.0.us: a finite")


def test_shown_never_raises_on_huge_integers() -> None:
    assert shown(10**5000) == "an integer of 16610 bits"  # repr() would raise ValueError
    assert shown("x" * 100) == repr("x" * 57)[:57] + "..."


# -- the schemas ------------------------------------------------------------------------------
def test_booleans_are_not_numbers() -> None:
    for path in (("cache", "num_blocks"), ("spec", "acceptance", "rates")):
        value = True if path[-1] != "rates" else [True, 0.5]
        with pytest.raises(ScenarioError, match="valid"):
            parse_scenario(_set(BASE, path, value), "f")


def test_draft_width_must_fit_the_token_budget() -> None:
    """Regression: max_num_tokens 2 with max_draft_len 2 (W = 3) ran and reported LIVENESS."""
    sc = _set(_set(BASE, ("spec", "max_draft_len"), 2), ("scheduler", "max_num_tokens"), 3)
    parse_scenario(sc)
    with pytest.raises(ScenarioError) as e:
        parse_scenario(_set(sc, ("scheduler", "max_num_tokens"), 2), "f")
    assert str(e.value) == ("f: scenario: scheduler.max_num_tokens (2) must be >= 1 + "
                            "spec.max_draft_len (3), one step's tokens")


@pytest.mark.parametrize("mult, ok", [((0.0, 1.25), True), ((0.0, 1.26), False),
                                      ((-0.1, 1.0), False), ((1.0, 0.9), False)])
def test_request_multiplier_keeps_rates_probabilities(mult, ok) -> None:
    sc = _set(BASE, ("spec", "acceptance", "request_multiplier"), list(mult))  # rates 0.8, 0.5
    if ok:
        parse_scenario(sc)
    else:
        with pytest.raises(ScenarioError, match="spec.acceptance: request_multiplier"):
            parse_scenario(sc, "f")


def test_union_error_is_one_line_naming_the_field() -> None:
    """Regression: a bad inline [cost.model] printed one line per union member, and a rates
    acceptance's field was shown as `spec.acceptance.rates.request_multiplier`."""
    model = {"num_layers": 1.5, "hidden": 8, "num_q_heads": 8, "num_kv_heads": 2,
             "head_dim": 64, "intermediate": 64, "vocab": 100}
    with pytest.raises(ScenarioError) as e:
        parse_scenario({**BASE, "cost": {"kind": "roofline", "model": model}}, "f")
    assert str(e.value) == "f: cost.model.num_layers: Input should be a valid integer (got 1.5)"
    with pytest.raises(ScenarioError) as e:
        parse_scenario(_set(BASE, ("spec", "acceptance", "request_multiplier"), ["x", 1]), "f")
    assert str(e.value).startswith("f: spec.acceptance.request_multiplier.0: ")


def _synthetic(**kw: object) -> dict:
    return {"num_requests": 4, "qps": 10.0, "prompt_len": {"kind": "constant", "value": 8},
            "output_len": {"kind": "constant", "value": 2}} | kw


def test_arrival_span_boundary() -> None:
    SyntheticConfig.model_validate(_synthetic(qps=3 * 1e9 / 2**58 * 1.001))
    with pytest.raises(ValueError, match="qps: num_requests / qps"):
        SyntheticConfig.model_validate(_synthetic(qps=3 * 1e9 / 2**58 * 0.999))


def test_drawn_arrivals_that_overflow_are_refused() -> None:
    """Regression: a tiny qps made arrival times wrap to INT64_MIN. Gaps a config cannot
    foresee (gamma, huge cv) are checked as drawn."""
    cfg = SyntheticConfig.model_construct(**_synthetic(qps=1e-12), arrival="poisson")
    with pytest.raises(WorkloadError, match="below 2\\*\\*62 ns"):
        draw_arrivals(cfg, 4, 1e-12, np.random.default_rng(0))


def test_workload_tokens_boundary() -> None:
    longest = {"kind": "constant", "value": 10_000_000}  # + 2 output tokens a request
    n = MAX_WORKLOAD_TOKENS // 10_000_002
    SyntheticConfig.model_validate(_synthetic(num_requests=n, prompt_len=longest))
    with pytest.raises(ValueError, match="num_requests: num_requests"):
        SyntheticConfig.model_validate(_synthetic(num_requests=n + 1, prompt_len=longest))
    # sessions: turn t holds the turns before it; the drawn lengths are counted exactly
    prompt = ConstantLength.model_construct(kind="constant", value=MAX_WORKLOAD_TOKENS // 8)
    cfg = SyntheticConfig.model_construct(
        num_requests=4, qps=10.0, arrival="poisson", cv=None, prompt_len=prompt,
        output_len=ConstantLength(kind="constant", value=2), vocab_size=50,
        shared_prefix=None, sessions=Sessions(num_turns=4, think_ns=0))
    with pytest.raises(WorkloadError, match="drawn requests hold"):  # (2**27 + 2) * (4+3+2+1)
        plan_synthetic(cfg, np.random.default_rng(0))


def test_grid_points_boundary() -> None:
    grid = {"a": list(range(64)), "b": list(range(64))}
    assert len(SweepSpec.model_validate({"base": "b", "grid": grid}).points()) == \
        MAX_GRID_POINTS
    with pytest.raises(ValueError, match=f"grid: the values' product must be <= "
                                         f"{MAX_GRID_POINTS} points \\(got 4160\\)"):
        SweepSpec.model_validate({"base": "b", "grid": {**grid, "b": list(range(65))}})


def test_mooncake_timestamp_too_large_for_a_float() -> None:
    """Regression: math.isfinite(10**400) raised OverflowError (a traceback)."""
    row = json.dumps({"timestamp": 10**400, "input_length": 4, "output_length": 1,
                      "hash_ids": [1]})
    with pytest.raises(WorkloadError, match="field 'timestamp' must be a non-negative"):
        parse_mooncake(row, "t", 0, None)


# -- command-line options ---------------------------------------------------------------------
def test_option_ranges() -> None:
    check_workers(MAX_WORKERS)
    assert _error(check_workers, MAX_WORKERS + 1) == \
        f"--workers: 0 to {MAX_WORKERS} processes (got {MAX_WORKERS + 1})"
    check_seconds(86_400, "--budget")
    for bad in (float("inf"), float("nan"), 0.0, 86_401):
        with pytest.raises(OptionError, match="--budget: seconds in"):
            check_seconds(bad, "--budget")


def _error(fn, *args) -> str:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except (ScenarioError, OptionError, WorkloadError) as e:
        return str(e)
    return "no error"
