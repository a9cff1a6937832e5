"""bench/gpu_pair.py: A and B alternate on the CPU reference backend and every wall is kept,
with the same rows from both; bad input is a usage error (exit 2), no JSON left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_pair.py"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_a_and_b_alternate_and_give_the_same_rows(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    p = _bench("--backend", "reference", "--sweep", "4x64:3", "--set", "replay.loop.BANK=0",
               "--set", "replay.loop.EARLY=1", "--reps", "3", "--work", str(tmp_path),
               "--json", str(out))
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert d["b"] == ["replay.loop.BANK=0", "replay.loop.EARLY=1"] and d["backend"] == "reference"
    (size,) = d["sizes"]
    assert (size["batch"], size["kv"], size["steps"]) == (4, 64, 3)
    for k in ("a", "b"):
        assert len(size[k]["wall_ms"]) == 3 and min(size[k]["wall_ms"]) > 0
        assert size[k]["prepared_ahead"] == [0, 0, 0]  # the CPU has no device to wait for
        assert len(size[k]["host_ms"]) == 3 and min(size[k]["host_ms"]) > 0  # the host's speed
    assert size["same_rows"] is True and 0 <= size["pairs_b_faster"] <= 3
    assert size["b_over_a"] == pytest.approx(size["b"]["wall_ms_median"] /
                                             size["a"]["wall_ms_median"])
    assert "B/A" in p.stdout


@pytest.mark.parametrize(("args", "says"), [
    (["--set", "replay.loop.BANK"], "MODULE.NAME=VALUE"),
    (["--set", "nosuch.BANK=0"], "no module gpu_backend.nosuch"),
    (["--set", "replay.loop.NOSUCH=0"], "has no NOSUCH"),
    (["--set", "replay.loop.BANK=zero"], "not a Python literal"),
    ([], "B is A"),
    (["--set", "replay.loop.BANK=0", "--sweep", "64by2048"], "BATCHxKV"),
    (["--set", "replay.loop.BANK=0", "--sweep", "0x64"], "must be positive"),
    (["--set", "replay.loop.BANK=0", "--reps", "0"], "--reps"),
])
def test_bad_input_is_a_usage_error(tmp_path: Path, args: list[str], says: str) -> None:
    out = tmp_path / "p.json"
    p = _bench("--backend", "reference", "--work", str(tmp_path), "--json", str(out), *args)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr
    assert not out.exists() and not list(tmp_path.glob("*.part"))


def test_flashinfer_without_a_gpu_stack_says_what_to_use(tmp_path: Path) -> None:
    """The default backend on a machine without FlashInfer or CUDA: a usage error naming
    the reference backend, not a traceback."""
    import importlib.util

    import torch

    if importlib.util.find_spec("flashinfer") and torch.cuda.is_available():
        pytest.skip("FlashInfer and CUDA are here: the default backend would run")
    out = tmp_path / "p.json"
    p = _bench("--set", "replay.loop.BANK=0", "--sweep", "4x64:3", "--work", str(tmp_path),
               "--json", str(out))
    assert p.returncode == 2 and "try --backend reference" in p.stderr
    assert "Traceback" not in p.stderr and not out.exists()
