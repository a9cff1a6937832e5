"""Roofline arithmetic on a tiny model, calibration interpolation, pool sizing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim.cost import (
    CostConfig,
    GpuSpec,
    ModelSpec,
    RooflineCost,
    SimpleCost,
    build_cost_model,
    load_calibration,
    num_blocks_for,
)
from sim.errors import ScenarioError

# linear params/layer = 8·(2+2)·4 + 2·4·8 + 3·8·16 = 576; LM head 32·8 = 256
TINY = ModelSpec(num_layers=2, hidden=8, num_q_heads=2, num_kv_heads=1, head_dim=4,
                 intermediate=16, vocab=32, dtype_bytes=2)
ONE_GHZ = GpuSpec(mem_bw=1e9, flops=1e9, mem_bytes=100_000)  # 1 byte = 1 ns, 1 FLOP = 1 ns


def tiny(**kw: object) -> RooflineCost:
    cfg = CostConfig(kind="roofline", model=TINY, gpu=ONE_GHZ, bw_efficiency=1.0,
                     flops_efficiency=1.0, launch_ns=100, draft_layers=1, **kw)  # type: ignore[arg-type]
    model = build_cost_model(cfg)
    assert isinstance(model, RooflineCost)
    return model


def dev(model: RooflineCost, q: list[int], kv: list[int], ctx: list[bool]) -> int:
    return model.device_ns(np.array(q), np.array(kv), np.array(ctx))


def test_shape_arithmetic() -> None:
    assert TINY.linear_params() == 576
    assert TINY.weight_bytes() == (2 * 576 + 2 * 256) * 2
    assert TINY.kv_bytes_per_token() == 2 * 2 * 1 * 4 * 2


def test_decode_is_bandwidth_bound() -> None:
    # bytes = weights 2816 + acts 416 + KV 32·(10 + 1) = 3584; flops = 2304 + 512 + 64·10 = 3456
    assert dev(tiny(), [1], [10], [False]) == 3584 + 100


def test_prefill_is_compute_bound() -> None:
    # causal pairs 100·(100 − 49.5) = 5050; flops = 2·100·2·576 + 2·256 + 64·5050 = 554112
    assert dev(tiny(), [100], [100], [True]) == 554112 + 100


def test_verify_adds_sequential_draft_passes() -> None:
    # main: flops 6912 + 1536 + 64·57 = 12096 > bytes 4800; two draft passes of
    # max(bytes (576+256)·2 + 16·20 = 1984, flops 2·(576+256) = 1664) each
    assert dev(tiny(), [3], [20], [False]) == 12096 + 2 * 1984 + 100


def test_empty_batch_costs_nothing() -> None:
    assert dev(tiny(), [], [], []) == 0


def test_host_time() -> None:
    m = tiny(host_base_ns=1000, host_ns_per_row=10, host_ns_per_token=1)
    assert m.host_ns(3, 50) == 1000 + 30 + 50


def test_simple_stays_default() -> None:
    m = build_cost_model(CostConfig())
    assert isinstance(m, SimpleCost)
    assert m.device_ns(np.array([1, 4]), np.array([10, 20]), np.array([False, False])) == \
        4_000_000 + 20_000 * 5 + 20 * 30


def test_unknown_preset_is_a_validation_error() -> None:
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'"):
        CostConfig(kind="roofline", model="llama-9")


def _attn(kind: str, batch: int, kv: int, q: int, us: float, heads: tuple = (2, 1, 4)) -> dict:
    return {"kind": kind, "batch": batch, "kv_len": kv, "q_len": q, "page_size": 16,
            "num_q_heads": heads[0], "num_kv_heads": heads[1], "head_dim": heads[2], "us": us}


@pytest.fixture
def table(tmp_path):
    grid = [("decode", 1, 100, 10.0), ("decode", 1, 1600, 50.0), ("decode", 4, 100, 20.0),
            ("decode", 4, 1600, 100.0)]
    data = {"meta": {"gpu": "test"},
            "attention": [_attn(k, b, kv, 1, us) for k, b, kv, us in grid]
            + [_attn("prefill", 1, 128, 128, 30.0), _attn("decode", 1, 100, 1, 9.0, (8, 8, 4))],
            "gemm": []}
    path = tmp_path / "calib.json"
    path.write_text(json.dumps(data))
    return path


def test_log_space_bilinear(table) -> None:
    cal = load_calibration(str(table), (2, 1, 4))
    assert cal.attention_us("decode", 2, 1, 400) == pytest.approx(45.0)  # halfway in log b, log kv
    assert cal.attention_us("decode", 1, 1, 100) == pytest.approx(10.0)  # a measured point
    assert cal.attention_us("decode", 8, 1, 3200) == pytest.approx(400.0)  # proportional past top
    assert cal.attention_us("decode", 1, 1, 50) == pytest.approx(10.0)  # clamped below
    assert cal.attention_us("prefill", 1, 64, 128) == pytest.approx(15.0)  # scaled by q_len
    assert cal.attention_us("verify", 1, 4, 128) is None


def test_missing_cell_is_filled_from_nearest(tmp_path) -> None:
    path = tmp_path / "c.json"
    pts = [("decode", 1, 100, 10.0), ("decode", 1, 1600, 50.0), ("decode", 4, 100, 20.0)]
    path.write_text(json.dumps({"attention": [_attn(k, b, kv, 1, us) for k, b, kv, us in pts]}))
    # (4, 1600) is nearest to (1, 1600) in log space: 50 · 4
    assert load_calibration(str(path), (2, 1, 4)).attention_us("decode", 4, 1, 1600) == 200.0


def test_calibrated_device_time(table) -> None:
    m = tiny(calibration=str(table))
    # linears: max(bytes 2·576·2 + 416·2, flops 2·2·2·576) = 4608; head max(512, 1024) = 1024;
    # attention 45 µs per layer · 2 layers
    assert dev(m, [1, 1], [400, 400], [False, False]) == 4608 + 1024 + 90_000 + 100


def test_gemm_table_replaces_linear_roofline(tmp_path) -> None:
    shapes = [(16, 8), (8, 8), (32, 8), (8, 16)]  # qkv, o, gate_up, down (n, k); head = gate_up
    gemm = [{"m": m, "n": n, "k": k, "us": 1.0 * m} for n, k in shapes for m in (2, 64)]
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"attention": [], "gemm": gemm}))
    m = tiny(calibration=str(path))
    # 4 GEMMs · 2 µs (m = 2, linear in m) · 2 layers; head on roofline 1024; attention roofline
    # max(32·(2·10 + 2), 64·20) = 1280
    assert dev(m, [1, 1], [10, 10], [False, False]) == 16_000 + 2000 + 1280 + 100


def test_calibration_errors_name_the_file(tmp_path, table) -> None:
    with pytest.raises(ScenarioError, match=r"calib.json: attention: no entry .* \(4, 4, 4\)"):
        load_calibration(str(table), (4, 4, 4))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"attention": [{"kind": "decode"}]}))
    with pytest.raises(ScenarioError, match=r"bad.json: attention\[0\]: missing field"):
        load_calibration(str(bad), (2, 1, 4))
    with pytest.raises(ScenarioError, match="cannot read calibration"):
        load_calibration(str(tmp_path / "nope.json"), (2, 1, 4))


def test_num_blocks_for() -> None:
    # (100000·0.5 − weights 3328) // (4 tokens · 32 bytes)
    assert num_blocks_for(TINY, ONE_GHZ, 4, 0.5) == (50_000 - 3328) // 128
    n = num_blocks_for("llama-3.1-8b", "h200", 32, 0.9)
    assert n == (int(141e9 * 0.9) - 16_060_522_496) // (32 * 131072)
    with pytest.raises(ValueError, match="leave no room"):
        num_blocks_for("llama-3.1-70b", "h100", 32, 0.9)
