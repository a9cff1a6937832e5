"""Chrome trace-event JSON: lanes, async request spans, counters, atomic write."""

from __future__ import annotations

import json

import pyarrow as pa

from sim.timeline import write_timeline


def tables() -> tuple[pa.Table, pa.Table]:
    steps = pa.table({"step": [0, 1], "t_sched_ns": [0, 2000], "t_launch_ns": [1000, 3000],
                      "t_dev_start_ns": [1000, 5000], "t_dev_end_ns": [5000, 9000],
                      "num_rows": [1, 2], "num_ctx": [1, 0], "num_gen": [0, 2],
                      "num_tokens": [58, 8], "blocks_used": [2, 4], "blocks_free": [6, 4],
                      "blocks_cached": [0, 1], "processed_step": [-1, 0]})
    requests = pa.table({"request": [0, 1], "arrival_ns": [0, 0], "first_token_ns": [5000, -1],
                         "finish_ns": [9000, -1], "prompt_len": [58, 10],
                         "reused_tokens": [0, 0],
                         "output_tokens": pa.array([[1, 2], []], pa.list_(pa.int32())),
                         "finish_reason": ["length", "rejected"], "num_preemptions": [0, 0]})
    return steps, requests


def test_structure(tmp_path) -> None:
    out = tmp_path / "t.json"
    n = write_timeline(*tables(), out)
    doc = json.loads(out.read_text())
    ev = doc["traceEvents"]
    assert n == len(ev) == 4 + 2 * 3 + 6
    host = [e for e in ev if e.get("tid") == 1 and e["ph"] == "X"]
    dev = [e for e in ev if e.get("tid") == 2 and e["ph"] == "X"]
    # schedule 1 (2..3 µs) runs while forward 0 (1..5 µs) is on the device: overlap is visible
    assert [(e["ts"], e["dur"]) for e in host] == [(0.0, 1.0), (2.0, 1.0)]
    assert [(e["ts"], e["dur"]) for e in dev] == [(1.0, 4.0), (5.0, 4.0)]
    counters = [e["args"] for e in ev if e["ph"] == "C"]
    assert counters == [{"used": 2, "free": 6, "cached": 0}, {"used": 4, "free": 4, "cached": 1}]
    spans = [(e["ph"], e["name"], e["ts"]) for e in ev if e.get("cat") == "request"]
    assert spans == [("b", "request 0", 0.0), ("b", "waiting", 0.0), ("e", "waiting", 5.0),
                     ("b", "decoding", 5.0), ("e", "decoding", 9.0), ("e", "request 0", 9.0)]
    assert all(e["id"] == 0 for e in ev if e.get("cat") == "request")  # rejected one: none
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temp file left


def test_cli_errors_exit_2(tmp_path) -> None:
    from typer.testing import CliRunner

    from sim.cli import app

    r = CliRunner().invoke(app, ["timeline", str(tmp_path), "--out", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and str(tmp_path) in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.json").exists()
