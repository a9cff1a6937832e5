"""bench/replay_host.py (`make bench-replay-host`): a small sweep runs end to end and writes every
figure, --before gives after/before ratios; bad input is a usage error (exit 2), no JSON left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim import heap

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "replay_host.py"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_a_small_sweep_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    common = ["--sweep", "8x256", "--steps", "10", "--reps", "1", "--work", str(tmp_path)]
    p = _bench(*common, "--json", str(out))
    assert p.returncode == 0, p.stderr
    (size,) = json.loads(out.read_text())["sizes"]
    assert (size["batch"], size["kv"]) == (8, 256)
    for k in ("start_ms", "prompt_ms", "first_ms", "rest_ms", "prepare_us"):
        assert 0 < size[k] < 1e6, k
    if heap.available():  # the same figures with glibc's default heap, and their ratios
        assert size["heap_default"]["prepare_us"] > 0
        assert 0 < size["kept_over_default"]["prompt_ms"] < 100
    again = tmp_path / "again.json"
    p = _bench(*common, "--json", str(again), "--before", str(out))
    assert p.returncode == 0, p.stderr
    (ratio,) = json.loads(again.read_text())["after_over_before"]
    assert set(ratio) >= {"prompt_ms", "prepare_us"}  # the same figures, before and after
    p = _bench(*common, "--no-heap-default", "--json", str(again))
    assert p.returncode == 0, p.stderr
    assert "heap_default" not in json.loads(again.read_text())["sizes"][0]


@pytest.mark.parametrize(("args", "says"), [
    (["--sweep", "64by2048"], "is not BATCHxKV"),
    (["--sweep", "0x2048"], "batch must be 1 or more"),
    (["--steps", "0"], "--steps: '0' is not a whole number of 1 or more"),
    (["--before", "/no/such.json"], "--before /no/such.json"),
])
def test_bad_input_is_a_usage_error(tmp_path: Path, args: list[str], says: str) -> None:
    out = tmp_path / "r.json"
    p = _bench(*args, "--json", str(out))
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()
