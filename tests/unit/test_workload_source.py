"""No silent stand-in: a missing trace file is an error unless --synthetic-workload asks for the
scenario's fallback, and the manifest, `run --json` and the screen say where requests came from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.sweep import load_sweep, run_sweep
from sim.workload import WorkloadError

SCENARIO = """
seed = 1
[cache]
tokens_per_block = 16
num_blocks = 200
[scheduler]
max_batch_size = 8
[limits]
max_seq_len = 1024
[workload.trace]
path = "{path}"
format = "azure2023"
[workload.trace.fallback]
num_requests = 6
qps = 5.0
prompt_len = {{ kind = "uniform", min = 20, max = 60 }}
output_len = {{ kind = "constant", value = 4 }}
"""
ROWS = "TIMESTAMP,ContextTokens,GeneratedTokens\n" \
       "2023-11-16 18:17:03.9799600,40,3\n2023-11-16 18:17:04.0319600,30,2\n"


def scenario(tmp_path: Path, path: str = "absent.csv") -> Path:
    (tmp_path / "s.toml").write_text(SCENARIO.format(path=path))
    return tmp_path / "s.toml"


def kvsim(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.output


def test_missing_trace_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    code, out = kvsim("run", str(scenario(tmp_path)), "--out", str(tmp_path / "t"))
    assert code == 2 and len(out.strip().splitlines()) == 1, out
    assert out.startswith("error: workload.trace.path: an existing azure2023 trace file, or "
                          "--synthetic-workload to run workload.trace.fallback instead (got "
                          "'absent.csv': no such file; tried ")
    assert str(tmp_path / "absent.csv") in out and not (tmp_path / "t").exists()


def test_stand_in_is_recorded(tmp_path: Path) -> None:
    code, out = kvsim("run", str(scenario(tmp_path)), "--synthetic-workload", "--json",
                      "--out", str(tmp_path / "t"))
    assert code == 0, out
    record = json.loads(out)["summary"]["workload"]
    assert record["source"] == "synthetic" and record["generator"]["num_requests"] == 6
    assert record["stand_in_for"] == {"path": "absent.csv", "format": "azure2023"}
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["workload"] == record
    assert "synthetic" in manifest["scenario"]["workload"]  # the scenario that ran
    code, out = kvsim("run", str(scenario(tmp_path)), "--synthetic-workload")
    assert code == 0 and "synthetic, standing in for absent.csv" in out, out


def test_trace_is_recorded_with_its_digest(tmp_path: Path) -> None:
    (tmp_path / "az.csv").write_text(ROWS)
    code, out = kvsim("run", str(scenario(tmp_path, "az.csv")), "--json",
                      "--out", str(tmp_path / "t"))
    assert code == 0, out
    want = {"source": "trace", "format": "azure2023", "path": str(tmp_path / "az.csv"),
            "sha256": hashlib.sha256(ROWS.encode()).hexdigest(), "rows": 2}
    assert json.loads(out)["summary"]["workload"] == want
    assert json.loads((tmp_path / "t" / "manifest.json").read_text())["workload"] == want
    code, out = kvsim("run", str(scenario(tmp_path, "az.csv")))
    assert code == 0 and "(2 rows)" in out, out


def test_flag_needs_a_fallback(tmp_path: Path) -> None:
    (tmp_path / "s.toml").write_text(SCENARIO.format(path="x").split("[workload.trace]")[0]
                                     + "[[workload.requests]]\narrival_ns = 0\nprompt_len = 3\n"
                                     "output_len = 1\n")
    code, out = kvsim("run", str(tmp_path / "s.toml"), "--synthetic-workload")
    assert (code, out.strip()) == (2, "error: --synthetic-workload: a scenario whose "
                                      "workload.trace has a workload.trace.fallback to run "
                                      "instead (got workload.requests)")


def test_sweep_stand_in(tmp_path: Path) -> None:
    scenario(tmp_path)
    (tmp_path / "w.toml").write_text('base = "s.toml"\n[grid]\n"scheduler.max_batch_size" = [4]\n')
    spec, base = load_sweep(tmp_path / "w.toml")
    with pytest.raises(WorkloadError, match="workload.trace.path: an existing azure2023"):
        run_sweep(spec, base, tmp_path / "o", workers=1)
    res = run_sweep(spec, base, tmp_path / "o", workers=1, synthetic_workload=True)
    assert res.results.column("requests").to_pylist() == [6]
