"""bench/cpu_replay.py (`make bench-cpu-replay`): a trace's CPU reference replay timed, its
verdicts kept; bad input is a usage error (exit 2), no JSON left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from replay_traces import SCENARIOS

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_replay.py"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_a_trace_is_replayed_and_timed(tmp_path: Path) -> None:
    trace = SCENARIOS["append_past_alloc"](tmp_path / "t")
    out = tmp_path / "r.json"
    p = _bench(str(trace), "--steps", "3", "--reps", "2", "--json", str(out))
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["steps"] == 3 and len(r["walls_s"]) == 2 and r["wall_s"] > 0
    assert r["rows_per_s"] == r["rows"] / r["wall_s"]
    # the scenario's fault is in its step 3: the first 3 steps are clean
    assert r["verdicts"]["ok"] == r["rows"] and r["verdicts"]["corrupt"] == 0
    assert "commit" in r  # the environment, as every bench records it


def test_bad_input_is_a_usage_error(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    for args, says in ((["/no/such/trace"], "not a trace directory"),
                       ([str(tmp_path), "--steps", "0"], "--steps: '0' is not a whole number")):
        p = _bench(*args, "--json", str(out))
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr
        assert not out.exists()
