"""`kvsim record --engine vllm`: what vLLM cannot run, or cannot be run with, is bad input.

Each case exits 2 with one `error:` line naming the field (or the make target), no
traceback, and nothing at --out. None of them needs .venv-vllm: the refusals come first.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.cli import app

GOOD = """seed = 1
profile = "vllm-v1"
[cache]
tokens_per_block = 16
num_blocks = 32
reuse = "full"
[overlap]
enabled = false
[workload.synthetic]
num_requests = 2
arrival = "poisson"
qps = 100.0
prompt_len = { kind = "uniform", min = 8, max = 16 }
output_len = { kind = "uniform", min = 2, max = 4 }
"""


def _record(tmp_path: Path, text: str, *extra: str) -> tuple[int, str, Path]:
    sc = tmp_path / "s.toml"
    sc.write_text(text)
    out = tmp_path / "trace"
    r = CliRunner().invoke(app, ["record", "--engine", "vllm", str(sc), "--out", str(out),
                                 *extra])
    return r.exit_code, r.output, out


@pytest.mark.parametrize("change, field", [
    (('profile = "vllm-v1"', 'profile = "trtllm-post-17264"'), "profile"),
    (('reuse = "full"', 'reuse = "partial-copy"'), "cache.reuse"),
    (('reuse = "full"', 'reuse = "partial-nocopy"'), "cache.reuse"),
    (("enabled = false", "enabled = true"), "overlap.enabled"),
    (("[overlap]", '[switches]\nbackend = "xqa"\n[overlap]'), "switches.backend"),
    (("[overlap]", '[scheduler]\npolicy = "max-utilization"\n[overlap]'), "scheduler.policy"),
    (("[overlap]", '[spec]\nmode = "mtp"\nmax_draft_len = 2\nextra_kv_tokens = 1\n[overlap]'),
     "spec.extra_kv_tokens"),
    (("[overlap]", '[spec]\nmode = "mtp"\nmax_draft_len = 2\nruntime_draft_lens = [1, 2]\n'
      "[overlap]"), "spec.runtime_draft_lens"),
    (("[overlap]", "[scheduler]\nmax_batch_size = 8\nmax_num_tokens = 4\n[overlap]"),
     "scheduler.max_num_tokens"),
    (("[overlap]", "[scheduler]\nchunk_size = 5000\n[overlap]"), "scheduler.chunk_size"),
    (("[overlap]", '[spec]\nmode = "mtp"\nmax_draft_len = 2\n[scheduler]\nchunk_size = 2\n'
      "[overlap]"), "scheduler.chunk_size"),
])
def test_features_vllm_has_not_are_refused(tmp_path, change, field):
    code, out, trace = _record(tmp_path, GOOD.replace(*change))
    assert code == 2, out
    assert out.startswith("error: ") and out.count("error:") == 1 and f": {field}: " in out
    assert "Traceback" not in out and not trace.exists()


def test_no_vllm_environment_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_VLLM_PYTHON", str(tmp_path / "none" / "python"))
    code, out, trace = _record(tmp_path, GOOD)
    assert code == 2 and "make vllm-env" in out, out
    assert not trace.exists() and not list(tmp_path.glob("trace.tmp-*"))


def test_another_vllm_version_is_refused(tmp_path, monkeypatch):
    # an interpreter whose vLLM says it is another version: the driver's first line
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho \'{"vllm": "0.32.1"}\'\ncat >/dev/null\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("KVSIM_VLLM_PYTHON", str(fake))
    code, out, trace = _record(tmp_path, GOOD)
    assert code == 2 and "vllm 0.32.1" in out and "pinned to 0.33.0" in out, out
    assert not trace.exists() and not list(tmp_path.glob("trace.tmp-*"))


def test_unknown_engine(tmp_path):
    (tmp_path / "s.toml").write_text(GOOD)
    r = CliRunner().invoke(app, ["record", "--engine", "sglang", str(tmp_path / "s.toml"),
                                 "--out", str(tmp_path / "t")])
    assert r.exit_code == 2 and "--engine" in r.output and "sglang" in r.output, r.output
    assert sorted(os.listdir(tmp_path)) == ["s.toml"]


def test_vllm_stays_in_its_own_environment():
    """The driver runs in .venv-vllm: stdlib and vLLM only (torch for one dtype vLLM's types
    want). Nothing else of kvsim imports vLLM, so the core install never needs it."""
    import ast
    import sys

    root = Path(__file__).resolve().parents[2]

    def imported(f: Path) -> set[str]:
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module.split(".")[0])
        return out

    driver = root / "sim" / "engines" / "vllm_driver.py"
    extra = imported(driver) - set(sys.stdlib_module_names) - {"__future__"}
    assert extra == {"vllm", "torch"}, extra
    for f in (root / "sim").rglob("*.py"):
        if f != driver:
            assert "vllm" not in imported(f), f
