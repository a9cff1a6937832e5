"""Real simulator traces through the CPU reference replay, and the agreement matrix tooling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from replay_traces import EXPECTED, SCENARIOS

from gpu_backend.host.staging import F64, HOST32, I32, MASK, Chunk, stage
from gpu_backend.replay.run import run_replay
from gpu_backend.tools.agreement import main as agreement_main
from gpu_backend.verdicts import DEFAULT_TOL

ROOT = Path(__file__).resolve().parents[2]


def _simulate(tmp: Path, fault: str) -> Path:
    out = tmp / fault
    p = subprocess.run([sys.executable, "-c", "from sim.cli import main; main()", "run",
                        f"scenarios/faults/{fault}.toml", "--profile",
                        f"trtllm-post-17264+{fault}", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert out.exists(), p.stdout[-2000:] + p.stderr[-2000:]
    return out


def _bad(res: object) -> dict[tuple[int, int], str]:
    return {(r.step, r.request): r.verdict for r in res.rows if r.verdict != "ok"}  # type: ignore[attr-defined]


def test_append_into_shared_block_is_corrupt_where_the_simulator_says_i5(tmp_path: Path) -> None:
    trace = _simulate(tmp_path, "append_into_shared")
    res = run_replay(trace, "reference", DEFAULT_TOL)
    corrupt = {k for k, v in _bad(res).items() if v == "corrupt"}
    assert corrupt == {(9, 1), (10, 1)}  # the I5 violations' (step, request)
    assert {v for v in _bad(res).values()} == {"corrupt", "mismatch"}


def test_first_gen_on_the_host_estimate_reads_poison(tmp_path: Path) -> None:
    res = run_replay(_simulate(tmp_path, "first_gen_host_estimate"), "reference", DEFAULT_TOL)
    assert _bad(res) == {(1, 0): "nan", (2, 0): "nan"}


def test_the_fixed_profile_replays_clean(tmp_path: Path) -> None:
    out = tmp_path / "clean"
    subprocess.run([sys.executable, "-c", "from sim.cli import main; main()", "run",
                    "scenarios/faults/uncorrected_overlap.toml", "--out", str(out)],
                   capture_output=True, text=True, cwd=ROOT)
    assert run_replay(out, "reference", DEFAULT_TOL).ok


def test_agreement_matrix_with_the_reference_backend(tmp_path: Path) -> None:
    names = ("clean_mtp", "append_past_alloc")
    traces = [str(SCENARIOS[n](tmp_path / n)) for n in names]
    exp = tmp_path / "expected.json"
    exp.write_text(json.dumps({n: {f"{s},{r}": v for (s, r), v in EXPECTED[n].items()}
                               for n in names}))
    md = tmp_path / "a.md"
    assert agreement_main([*traces, "--out", str(md), "--expected", str(exp),
                           "--backends", "reference"]) == 0
    text = md.read_text()
    assert "| append_past_alloc | 8 | none | (3,0) corrupt; (3,1) mismatch |" in text
    assert "**no**" not in text


@pytest.mark.parametrize("shape", [(3,), (2, 4)])
def test_staging_keeps_names_shapes_and_copies(shape: tuple[int, ...]) -> None:
    chunk = Chunk("cpu")
    a = np.arange(int(np.prod(shape))).reshape(shape)
    out = stage(chunk, {"a": a, "b": np.array([7, 0]), "f": np.array([0.5, 3.0])})
    other = stage(chunk, {"a": np.array([9])})  # a second step in the same chunk
    chunk.upload()
    assert out["a"].tolist() == a.tolist() and out["b"].tolist() == [7, 0]
    assert out.view("a", I32).dtype == torch.int32 and out.view("a", I32).tolist() == a.tolist()
    assert out.view("b", HOST32).dtype == torch.int32 and out.view("b", HOST32).tolist() == [7, 0]
    assert out.view("b", MASK).tolist() == [True, False]
    assert out.view("f", F64).tolist() == [0.5, 3.0]
    assert other["a"].tolist() == [9] and len(out) == 3


def test_agreement_compares_the_simulator_with_each_backend() -> None:
    from gpu_backend.tools.agreement import plan_cache_note, summary, versus_sim

    rows = [
        {"trace": "a.fault", "violations": ["I14@2"], "reference": {"2,0": "fault"},
         "flashinfer": {"2,0": "fault"}},
        {"trace": "b.fault", "violations": ["I14@8"], "reference": {}, "flashinfer": {},
         "flashinfer_stats": {"plan_cache_entries": 5, "plan_cache_device_bytes": 80 << 20,
                              "plan_cache_pinned_bytes": None}},
        {"trace": "a.fixed", "violations": [], "reference": {}, "flashinfer": {}},
        {"trace": "b.fixed", "violations": [], "reference": {},
         "flashinfer": {"*": "error: RuntimeError: x"}},
    ]
    assert [versus_sim(r, "flashinfer") for r in rows] == [
        "confirmed", "**missed**", "clean", "**error**"]
    assert versus_sim({"trace": "c", "violations": [], "reference": {"1,0": "nan"}},
                      "reference") == "**unflagged**"
    assert summary(rows, ["reference", "flashinfer"]) == [
        "- reference: 1/2 faulty runs confirmed (a verdict not ok); not seen: b; 2/2 fixed runs "
        "all ok",
        "- flashinfer: 1/2 faulty runs confirmed (a verdict not ok); not seen: b; 1/2 fixed runs "
        "all ok"]
    assert plan_cache_note(rows[1]) == "plan cache held: 5 wrapper pairs, 80 MiB device (measured)"
    assert plan_cache_note(rows[0]) == ""


def test_shared_blocks_follow_the_refcounts(tmp_path: Path) -> None:
    """event_ops keeps the blocks with refcount > 1 as a set beside the refcounts (no scan of
    the whole map per step): after every step it equals the scan it replaced."""
    from gpu_backend.host.events import event_ops, in_flight_poison
    from gpu_backend.trace import load_trace

    trace = load_trace(_simulate(tmp_path, "append_into_shared"))
    flight = in_flight_poison(trace)
    refcount: dict[int, int] = {}
    shared: set[int] = set()
    seen = []
    for s in trace.steps:
        event_ops(trace, s.step, 1, refcount, flight, {}, shared)
        assert shared == {b for b, n in refcount.items() if n > 1}
        seen.append(len(shared))
    assert max(seen) > 0  # reused prefix blocks have two holders
