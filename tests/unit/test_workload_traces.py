"""Trace sources: Azure 2023 CSV and Mooncake JSONL readers, path resolution, the stand-in, every
error path, and the real shared traces when this machine has them."""

import calendar
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from sim.workload import (
    RequestSpec,
    SyntheticConfig,
    WorkloadConfig,
    WorkloadError,
    build_workload,
    open_workload,
    stand_in,
)
from sim.workload.readers import azure_timestamp_ns
from sim.workload.traces import REPO_ROOT, mooncake_tokens

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
FALLBACK = {"num_requests": 5, "qps": 2.0, "prompt_len": {"kind": "constant", "value": 3},
            "output_len": {"kind": "constant", "value": 2}}


def trace(path: Path | str, fmt: str, **kw) -> WorkloadConfig:
    return WorkloadConfig.model_validate({"trace": {"path": str(path), "format": fmt} | kw})


def load(cfg: WorkloadConfig, seed: int = 0, base_dir: Path | None = None) -> list[RequestSpec]:
    return build_workload(cfg, np.random.default_rng(seed), tokens_per_block=16,
                          base_dir=base_dir)


def write_azure(tmp_path: Path, rows: list[str], eol: str = "\r\n", final: str = "") -> Path:
    f = tmp_path / "az.csv"
    f.write_bytes((eol.join([HEADER, *rows]) + final).encode())
    return f


def write_mooncake(tmp_path: Path, rows: list[dict | str]) -> Path:
    f = tmp_path / "mc.jsonl"
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    f.write_text("\n".join(lines) + "\n")
    return f


def mc(ts: int, n_in: int, n_out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


AZ_ROWS = ["2023-11-16 18:17:03.9799600,4808,10",
           "2023-11-16 18:17:04.0319600,3180,8",
           "2023-11-16 18:17:04.0319601,5,1",
           "2023-11-16 18:18:00.0000000,7,300"]


# ---- azure --------------------------------------------------------------------------------

def test_azure_timestamp_exact_ns():
    unix_s = calendar.timegm((2023, 11, 16, 18, 17, 3))
    assert azure_timestamp_ns("2023-11-16 18:17:03.9799600") == unix_s * 10**9 + 979_960_000
    assert azure_timestamp_ns("2023-11-16 18:17:03.123456789") == unix_s * 10**9 + 123_456_789
    assert azure_timestamp_ns("2023-11-16 18:17:03") == unix_s * 10**9
    for bad in ("2023-11-16T18:17:03.1", "2023-02-30 00:00:00.0", "2023-11-16 24:00:00.0",
                "2023-11-16 18:17:03.1234567890", " 2023-11-16 18:17:03.1"):
        assert azure_timestamp_ns(bad) is None, bad


@pytest.mark.parametrize("eol, final", [("\r\n", ""), ("\r\n", "\r\n"), ("\n", "\n")])
def test_azure_rows_exact(tmp_path, eol, final):
    got = load(trace(write_azure(tmp_path, AZ_ROWS, eol, final), "azure2023"))
    assert [r.arrival_ns for r in got] == [0, 52_000_000, 52_000_100, 56_020_040_000]
    assert [len(r.prompt) for r in got] == [4808, 3180, 5, 7]
    assert [r.output_len for r in got] == [10, 8, 1, 300]
    assert [r.rid for r in got] == [0, 1, 2, 3]


def test_azure_start_limit_scale_and_clamps(tmp_path):
    cfg = trace(write_azure(tmp_path, AZ_ROWS), "azure2023", start=1, limit=2, time_scale=0.5,
                max_prompt_len=100, max_output_len=5)
    got = load(cfg)
    # arrivals from the first row read, halved; 100 ns * 0.5 = 50 ns
    assert [r.arrival_ns for r in got] == [0, 50]
    assert [len(r.prompt) for r in got] == [100, 5]
    assert [r.output_len for r in got] == [5, 1]


def test_azure_tokens_are_seeded(tmp_path):
    cfg = trace(write_azure(tmp_path, AZ_ROWS), "azure2023", vocab_size=7)
    a, b, c = load(cfg, seed=1), load(cfg, seed=1), load(cfg, seed=2)
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0].prompt, c[0].prompt)
    assert int(a[0].prompt.max()) == 6 and int(a[0].prompt.min()) == 0


@pytest.mark.parametrize("rows, fragment", [
    (["2023-11-16 18:17:03.9799600,4808"],
     "line 2: expected 3 fields (TIMESTAMP,ContextTokens,GeneratedTokens), got 2"),
    (["2023-11-16 18:17:03.9799600,-3,10"],
     "line 2: field 'ContextTokens' must be a positive int, got '-3'"),
    (["2023-11-16 18:17:03.9799600,5,0"],
     "line 2: field 'GeneratedTokens' must be a positive int, got '0'"),
    (["2023-11-16 18:17:03.9799600,5,ten"],
     "line 2: field 'GeneratedTokens' must be a positive int, got 'ten'"),
    ([AZ_ROWS[0], "16/11/2023 18:17,5,1"],
     "line 3: field 'TIMESTAMP' must look like '2023-11-16 18:17:03.9799600', "
     "got '16/11/2023 18:17'"),
    ([AZ_ROWS[1], AZ_ROWS[0]], "line 3: field 'TIMESTAMP' must not decrease"),
    ([AZ_ROWS[0], "", AZ_ROWS[1]], "line 3: expected 3 fields"),
    ([AZ_ROWS[0], "2023-11-16 18:17:04.03"], "line 3: expected 3 fields"),  # truncated file
])
def test_azure_bad_rows(tmp_path, rows, fragment):
    f = write_azure(tmp_path, rows)
    with pytest.raises(WorkloadError) as e:
        load(trace(f, "azure2023"))
    assert f"azure2023 trace {f} {fragment}" in str(e.value)


def test_azure_bad_header_and_empty(tmp_path):
    f = tmp_path / "h.csv"
    f.write_text("time,in,out\r\n2023-11-16 18:17:03.9799600,1,1")
    with pytest.raises(WorkloadError, match="line 1: expected header "
                                            "'TIMESTAMP,ContextTokens,GeneratedTokens'"):
        load(trace(f, "azure2023"))
    f.write_text(HEADER + "\r\n")
    with pytest.raises(WorkloadError, match="no data rows after skipping start = 0"):
        load(trace(f, "azure2023"))
    f = write_azure(tmp_path, AZ_ROWS)
    with pytest.raises(WorkloadError, match="no data rows after skipping start = 4"):
        load(trace(f, "azure2023", start=4))


def test_rows_before_start_are_not_parsed(tmp_path):
    got = load(trace(write_azure(tmp_path, ["garbage", *AZ_ROWS[:2]]), "azure2023", start=1))
    assert [r.arrival_ns for r in got] == [0, 52_000_000]


def test_non_utf8(tmp_path):
    f = tmp_path / "bad.csv"
    head = f"{HEADER}\r\n{AZ_ROWS[0]}\r\n2023-11-16 18:17:04.0"
    f.write_bytes(head.encode() + b"\xff")
    with pytest.raises(WorkloadError, match=rf"line 3: not UTF-8 text \(byte {len(head)}\)"):
        load(trace(f, "azure2023"))
    g = tmp_path / "bad.jsonl"
    g.write_bytes(b'{"timestamp": 0, \xc3(}\n')
    with pytest.raises(WorkloadError, match=f"mooncake trace {g} line 1: not UTF-8"):
        load(trace(g, "mooncake"))


# ---- mooncake -----------------------------------------------------------------------------

def test_mooncake_block_content_is_pinned():
    # A stable function of (hash id, position) alone: changing it changes every trace workload.
    toks = mooncake_tokens(np.array([0, 1]), 514, 32000)
    assert toks[[0, 1, 2, 511, 512, 513]].tolist() == [29939, 30199, 16849, 30855, 25011, 86]
    assert toks.dtype == np.int32 and len(toks) == 514


def test_mooncake_shared_hash_ids_share_tokens(tmp_path):
    f = write_mooncake(tmp_path, [mc(0, 1100, 5, [0, 1, 2]), mc(3, 1024, 7, [0, 1]),
                                  mc(3, 600, 1, [0, 3]), mc(1500, 10, 2, [4])])
    got = load(trace(f, "mooncake"))
    a, b, c, d = (r.prompt for r in got)
    assert [len(p) for p in (a, b, c, d)] == [1100, 1024, 600, 10]  # last block partial
    assert [r.arrival_ns for r in got] == [0, 3_000_000, 3_000_000, 1_500_000_000]
    assert [r.output_len for r in got] == [5, 7, 1, 2]
    assert np.array_equal(a[:1024], b)  # same two blocks
    assert np.array_equal(a[:512], c[:512]) and not np.array_equal(a[512:600], c[512:])
    assert not np.array_equal(a[:10], d)
    # content comes from the ids alone: no seed, no block size
    other = build_workload(trace(f, "mooncake"), np.random.default_rng(9), tokens_per_block=3)
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(got, other, strict=True))


def test_mooncake_float_ms_and_clamps(tmp_path):
    f = write_mooncake(tmp_path, [mc(10, 700, 9, [5, 6]), mc(10.5, 20, 2, [7])])
    got = load(trace(f, "mooncake", max_prompt_len=600, max_output_len=4, time_scale=2.0))
    assert [r.arrival_ns for r in got] == [0, 1_000_000]
    assert [len(r.prompt) for r in got] == [600, 20]
    assert [r.output_len for r in got] == [4, 2]
    assert np.array_equal(got[0].prompt, mooncake_tokens(np.array([5, 6]), 600, 32000))


@pytest.mark.parametrize("rows, fragment", [
    ([mc(0, -3, 1, [])], "line 1: field 'input_length' must be a positive int, got -3"),
    ([mc(0, 5, 0, [1])], "line 1: field 'output_length' must be a positive int, got 0"),
    ([mc(0, 5, True, [1])], "line 1: field 'output_length' must be a positive int, got true"),
    ([mc(0, "5", 1, [1])], "line 1: field 'input_length' must be a positive int, got \"5\""),
    ([mc(0, 5, 1, [1]), mc(-1, 5, 1, [1])],
     "line 2: field 'timestamp' must be a non-negative number of ms, got -1"),
    ([mc(0, 5, 1, [1]), {"timestamp": 1, "input_length": 5, "hash_ids": [1]}],
     "line 2: missing field 'output_length'"),
    ([mc(0, 1025, 1, [1, 2])],
     "line 1: field 'hash_ids' has 2 ids, expected ceil(input_length / 512) = 3"),
    ([mc(0, 5, 1, [-1])], "line 1: field 'hash_ids' must be a list of non-negative ints"),
    ([mc(0, 5, 1, [1.5])], "line 1: field 'hash_ids' must be a list of non-negative ints"),
    ([mc(5, 5, 1, [1]), mc(4, 5, 1, [1])], "line 2: field 'timestamp' must not decrease"),
    ([mc(0, 5, 1, [1]), "[1, 2]"], "line 2: expected a JSON object, got [1, 2]"),
    ([mc(0, 5, 1, [1]), '{"timestamp": 3, "input_len'], "line 2: invalid JSON ("),  # truncated
    ([mc(0, 5, 1, [1]), "", mc(1, 5, 1, [1])], "line 2: invalid JSON (Expecting value"),
])
def test_mooncake_bad_rows(tmp_path, rows, fragment):
    f = write_mooncake(tmp_path, rows)
    with pytest.raises(WorkloadError) as e:
        load(trace(f, "mooncake"))
    assert f"mooncake trace {f} {fragment}" in str(e.value)


# ---- locating the file ---------------------------------------------------------------------

def test_relative_to_scenario_folder_then_repo_root(tmp_path):
    f = write_azure(tmp_path, AZ_ROWS[:2])
    assert len(load(trace("az.csv", "azure2023"), base_dir=tmp_path)) == 2
    from_root = os.path.relpath(f, REPO_ROOT)  # like "../shared/traces/..."
    assert len(load(trace(from_root, "azure2023"), base_dir=tmp_path / "elsewhere")) == 2


def test_missing_file_without_fallback(tmp_path):
    with pytest.raises(WorkloadError) as e:
        load(trace("nope/trace.csv", "azure2023"), base_dir=tmp_path)
    msg = str(e.value)
    assert msg.startswith("workload.trace.path: an existing azure2023 trace file (got "
                          "'nope/trace.csv': no such file; tried ")
    assert str(tmp_path / "nope" / "trace.csv") in msg


def test_missing_file_is_an_error_even_with_a_fallback(tmp_path):
    """The fallback once ran in the file's place unannounced: now only `stand_in` runs it."""
    cfg = trace("absent.jsonl", "mooncake", fallback=FALLBACK)
    with pytest.raises(WorkloadError, match=r"^workload.trace.path: an existing mooncake trace "
                       r"file, or --synthetic-workload to run workload.trace.fallback instead "
                       r"\(got 'absent.jsonl': no such file; tried "):
        load(cfg, base_dir=tmp_path)


def test_stand_in_is_the_fallback(tmp_path):
    got = load(stand_in(trace("absent.jsonl", "mooncake", fallback=FALLBACK)), seed=4)
    direct = load(WorkloadConfig.model_validate({"synthetic": FALLBACK}), seed=4)
    assert [(r.arrival_ns, r.prompt.tolist()) for r in got] == \
        [(r.arrival_ns, r.prompt.tolist()) for r in direct]
    with pytest.raises(WorkloadError, match=r"\(got workload.trace without workload.trace.fall"):
        stand_in(trace("absent.jsonl", "mooncake"))
    with pytest.raises(WorkloadError, match=r"\(got workload.synthetic\)$"):
        stand_in(WorkloadConfig.model_validate({"synthetic": FALLBACK}))


def test_source_records(tmp_path):
    f = write_azure(tmp_path, AZ_ROWS[:3])
    cfg = trace(f, "azure2023", limit=2)
    _, record = open_workload(cfg, np.random.default_rng(0), tokens_per_block=16)
    assert record == {"source": "trace", "format": "azure2023", "path": str(f.resolve()),
                      "sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "rows": 2}
    synthetic = WorkloadConfig.model_validate({"synthetic": FALLBACK})
    _, record = open_workload(synthetic, np.random.default_rng(0), tokens_per_block=16)
    assert record["source"] == "synthetic" and record["generator"]["qps"] == 2.0
    assert SyntheticConfig.model_validate(record["generator"]) == synthetic.synthetic


# ---- the real shared traces ------------------------------------------------------------------

REAL = [("azure2023", "azure2023/AzureLLMInferenceTrace_conv.csv"),
        ("azure2023", "azure2023/AzureLLMInferenceTrace_code.csv"),
        ("mooncake", "mooncake/conversation_trace.jsonl"),
        ("mooncake", "mooncake/synthetic_trace.jsonl")]


def first_rows(fmt: str, f: Path, n: int) -> list[tuple[int, int]]:
    if fmt == "mooncake":
        rows = [json.loads(line) for line in f.read_text().splitlines()[:n]]
        return [(r["input_length"], r["output_length"]) for r in rows]
    lines = f.read_text().splitlines()[1:n + 1]
    return [(int(x.split(",")[1]), int(x.split(",")[2])) for x in lines]


@pytest.mark.parametrize("fmt, name", REAL)
def test_real_traces_first_200_rows(fmt, name):
    f = SHARED / name
    if not f.is_file():
        pytest.skip(f"shared trace {f} not on this machine")
    got = load(trace(f, fmt, limit=200))
    assert len(got) == 200
    assert [(len(r.prompt), r.output_len) for r in got] == first_rows(fmt, f, 200)
    t = [r.arrival_ns for r in got]
    assert t[0] == 0 and t == sorted(t)
    if fmt == "mooncake":
        lines = [json.loads(line) for line in f.read_text().splitlines()[:200]]
        ids = [r["hash_ids"] for r in lines]
        assert all(len(i) == math.ceil(len(r.prompt) / 512) for i, r in zip(ids, got,
                                                                          strict=True))
        # every pair sharing their first block id shares those 512 tokens
        firsts = [i for i in range(200) if ids[i][0] == ids[0][0] and len(got[i].prompt) >= 512]
        assert all(np.array_equal(got[i].prompt[:512], got[firsts[0]].prompt[:512])
                   for i in firsts)


def test_real_trace_via_repo_relative_path():
    if not SHARED.is_dir():
        pytest.skip(f"shared traces {SHARED} not on this machine")
    cfg = trace("../shared/traces/mooncake/conversation_trace.jsonl", "mooncake", limit=3)
    assert len(load(cfg, base_dir=Path("/nonexistent"))) == 3
