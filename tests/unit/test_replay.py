"""CPU reference replay (`--backend reference`): the whole replay path without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from replay_traces import EXPECTED, SCENARIOS, _two

from gpu_backend.isolate import replay_isolated
from gpu_backend.layout import build_step
from gpu_backend.oracle import DEFAULT_TOL
from gpu_backend.pool import KVPool, content
from gpu_backend.run import run_replay
from gpu_backend.tracedata import load_trace
from sim.errors import TraceError

ROOT = Path(__file__).resolve().parents[2]


def _bad(res: object) -> dict[tuple[int, int], str]:
    return {(r.step, r.request): r.verdict for r in res.rows if r.verdict != "ok"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reference_verdicts(tmp_path: Path, name: str) -> None:
    res = run_replay(SCENARIOS[name](tmp_path / name), "reference", DEFAULT_TOL)
    assert _bad(res) == EXPECTED[name]
    assert max(r.err for r in res.rows if r.verdict == "ok") < DEFAULT_TOL / 4


def test_content_is_deterministic_and_position_sensitive() -> None:
    t = torch.tensor([7, 7, 8])
    p = torch.tensor([3, 4, 3])
    a = content(t, p, 0, 2, 64, torch.bfloat16)
    assert torch.equal(a, content(t, p, 0, 2, 64, torch.bfloat16))
    assert (a[0] - a[1]).abs().max() > 0.5 and (a[0] - a[2]).abs().max() > 0.5
    assert a.abs().max() <= 1.0


def test_pool_poison_guards_and_checksum() -> None:
    pool = KVPool(4, 2, 16, 2, 64, torch.bfloat16, "cpu")
    assert pool.data.shape == (8, 2, 16, 2, 64) and torch.isnan(pool.data).all()
    before = pool.checksum()
    pool.data[pool.index(1), 0, 3] = 0.5
    assert (pool.checksum() != before).nonzero().flatten().tolist() == [3]


def test_append_past_alloc_targets_the_next_rows_page(tmp_path: Path) -> None:
    t = load_trace(SCENARIOS["append_past_alloc"](tmp_path / "t"))
    b = build_step(t.steps[3], t.rows[3], 16, 16)
    row1_first = t.rows[3][1].pages[0] + 16
    assert b.engine_write.tolist()[0] == row1_first and not b.write_ok[0] and b.write_ok[1]


def test_isolated_reference_equals_in_process(tmp_path: Path) -> None:
    trace = SCENARIOS["append_past_alloc"](tmp_path / "t")
    assert _bad(replay_isolated(trace, "reference", DEFAULT_TOL)) == EXPECTED["append_past_alloc"]


def test_an_append_past_the_table_lands_on_a_guard_page(tmp_path: Path) -> None:
    b = _two(29, 45)
    b.step([replace(b.gen(0, 0, 0), append_pos=(500,)), b.gen(1, 0, 0)])
    res = run_replay(b.write(tmp_path / "t", "wild"), "reference", DEFAULT_TOL)
    assert [r.verdict for r in res.rows if r.step == 1] == ["corrupt", "ok"]


def test_a_page_id_past_the_guard_band_is_a_fault_on_the_reference(tmp_path: Path) -> None:
    b = _two(29, 45)
    r0 = b.gen(0, 0, 0)
    b.step([replace(r0, pages=(10_000,) + r0.pages[1:]), b.gen(1, 0, 0)])
    res = run_replay(b.write(tmp_path / "t", "wild"), "reference", DEFAULT_TOL)
    assert [r.verdict for r in res.rows if r.step == 1] == ["fault", "fault"]
    assert "outside the pool" in res.rows[-1].message


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from sim.cli import main; main()", "replay",
                           *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    clean = SCENARIOS["clean_decode"](tmp_path / "clean")
    bad = SCENARIOS["overlong_fa2"](tmp_path / "bad")
    assert _cli(str(clean), "--backend", "reference").returncode == 0
    p = _cli(str(bad), "--backend", "reference", "--json", str(tmp_path / "r.json"))
    assert p.returncode == 1 and "mismatch" in p.stdout
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["counts"]["mismatch"] == 1 and len(out["rows"]) == 8
    p = _cli(str(tmp_path / "missing"), "--backend", "reference")
    assert p.returncode == 2 and "Traceback" not in p.stderr + p.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_cli_flashinfer_without_cuda_says_so(tmp_path: Path) -> None:
    p = _cli(str(SCENARIOS["clean_decode"](tmp_path / "t")))
    assert p.returncode == 2 and "no CUDA device" in p.stdout and "Traceback" not in p.stderr


def test_an_incomplete_trace_is_refused(tmp_path: Path) -> None:
    t = SCENARIOS["clean_decode"](tmp_path / "t")
    m = json.loads((t / "manifest.json").read_text())
    (t / "manifest.json").write_text(json.dumps(dict(m, complete=False)))
    with pytest.raises(TraceError):
        load_trace(t)
