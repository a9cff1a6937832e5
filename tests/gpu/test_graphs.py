"""Steady steps as CUDA graphs (gpu_backend/device/graphs.py) give the eager replay's rows, and a
page
written inside a graph is found as one written by an eager step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from replay_traces import SCENARIOS, big_verify
from watch_cases import Stray

from gpu_backend.device.graphs import StepGraphs
from gpu_backend.replay.loop import replay
from gpu_backend.trace import TraceData, load_trace
from gpu_backend.verdicts import ReplayResult

pytestmark = pytest.mark.gpu


def _fi(trace: TraceData, graphs: bool) -> Any:
    from gpu_backend.replay.flashinfer import FlashInferKernels

    return FlashInferKernels(trace.model.num_q_heads, "cuda", graphs=graphs)


def _rows(res: ReplayResult) -> list[tuple[Any, ...]]:
    return [(r.step, r.row, r.request, r.verdict, r.message) for r in res.rows]


def _trace(tmp: Path, name: str) -> TraceData:
    if name == "big_verify":
        return load_trace(big_verify(tmp / name, batch=16, kv=512, steps=6))
    return load_trace(SCENARIOS[name](tmp / name))


# a key's graph is captured while the step before it runs (`StepGraphs.ahead`): its first step
# replays it too
@pytest.mark.parametrize(("name", "captures", "replays"), [
    ("clean_mtp", 1, 6), ("overlap_uncorrected", 1, 1), ("big_verify", 1, 6),
    ("append_past_alloc", 0, 0)])
def test_graphs_give_the_eager_rows(tmp_path: Path, name: str, captures: int,
                                    replays: int) -> None:
    trace = _trace(tmp_path, name)
    eager = replay(trace, _fi(trace, False), "cuda")
    graph = replay(trace, _fi(trace, True), "cuda")
    assert _rows(graph) == _rows(eager)
    # FA2's split-kv merge in graph mode rounds differently: far inside the tolerance
    diff = max(abs(a.err - b.err) for a, b in zip(graph.rows, eager.rows, strict=True)
               if a.verdict == "ok")
    assert diff < 2e-3
    assert (graph.stats["graph_captures"], graph.stats["graph_replays"],
            graph.stats["eager_fallbacks"], graph.stats["plan_mismatches"]) == \
        (captures, replays, 0, 0)
    assert "graph_replays" not in eager.stats


def test_a_page_written_inside_a_graph_is_found(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard page written by the graph's own work (captured, so every replay writes it): the
    whole-pool check finds it, the full watch pins it on the first step, as an eager step's."""
    trace = _trace(tmp_path, "big_verify")
    body = StepGraphs._body

    def stray_body(self: StepGraphs, *a: Any) -> Any:
        tok = body(self, *a)
        self.pool.data[1, 0, 0] = 0.25  # neither NaN (poison) nor content's bits
        return tok

    monkeypatch.setattr(StepGraphs, "_body", stray_body)
    got = replay(trace, _fi(trace, True), "cuda")
    want = replay(trace, Stray(_fi(trace, False), 1, 1), "cuda", watch="full")
    assert got.watch.startswith("full (incremental found a page changed outside")
    assert _rows(got) == _rows(want)
    assert {r.verdict for r in got.rows if r.step == 1} == {"corrupt"}
    assert got.stats["graph_replays"] == 6


def test_cli_eager_turns_the_graphs_off(tmp_path: Path) -> None:
    trace = SCENARIOS["clean_mtp"](tmp_path / "t")
    out = {}
    for flag in ("", "--eager"):
        js = tmp_path / f"r{flag}.json"
        p = subprocess.run([sys.executable, "-c", "from sim.cli import main; main()", "replay",
                            str(trace), "--json", str(js), *([flag] if flag else [])],
                           capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[2])
        assert p.returncode == 0, p.stdout + p.stderr
        out[flag] = json.loads(js.read_text())
    assert out[""]["stats"]["graph_replays"] == 6
    assert "graph_replays" not in out["--eager"]["stats"]
    assert [r["verdict"] for r in out[""]["rows"]] == [r["verdict"] for r in out["--eager"]["rows"]]


def test_a_capture_refused_ahead_runs_the_first_step_eagerly(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """If the capture ahead of a key's first step fails, that step plans, runs eagerly and
    captures (`StepGraphs._first`): the same rows, one graph, one replay fewer."""
    trace = _trace(tmp_path, "clean_mtp")
    capture, calls = StepGraphs._capture, []

    def refuse_once(self: StepGraphs, *a: Any) -> Any:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return capture(self, *a)

    monkeypatch.setattr(StepGraphs, "_capture", refuse_once)
    got = replay(trace, _fi(trace, True), "cuda")
    want = replay(trace, _fi(trace, False), "cuda")
    assert _rows(got) == _rows(want)
    assert len(calls) == 2
    assert (got.stats["graph_captures"], got.stats["graph_replays"],
            got.stats["eager_fallbacks"]) == (1, 5, 0)
