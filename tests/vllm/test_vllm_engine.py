"""The vLLM adapter against vLLM 0.33.0 itself (sim/engines/vllm*.py, `kvsim record`).

The cases below are vLLM's own tests (tests/v1/core/test_prefix_caching.py and
test_scheduler.py), driven through the real Scheduler step by step instead of through
KVCacheManager calls: the block ids, hit lengths and free counts they pin are vLLM's. They run
in one driver process (its start-up is most of the cost). Skipped only where .venv-vllm is
absent; `make test` builds it.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.api import load_scenario
from sim.check import StepChecker
from sim.cli import app
from sim.config import parse_scenario
from sim.engines.record import record
from sim.engines.vllm import VllmSession, vllm_python
from sim.engines.vllm_trace import Converter
from sim.errors import KvsimError, ScenarioError

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason="no .venv-vllm (make vllm-env)")

LATER = 10**6  # ns: long after the requests before it finished (a step here is ~1 µs)


def _req(i: int, prompt: list[int], arrival: int = 0) -> dict:
    # max_tokens 1: each request finishes (and is freed) right after its prefill, as the
    # tests free theirs right after allocating
    return {"id": i, "arrival_ns": arrival, "prompt": prompt, "output": [7, 7, 7],
            "output_len": 1, "accept": []}


def _case(block_size: int, num_blocks: int, reqs: list[dict], budget: int = 256,
          max_len: int = 8192) -> dict:
    return {"block_size": block_size, "num_blocks": num_blocks, "prefix_caching": True,
            "max_num_seqs": 16, "max_num_batched_tokens": budget,
            "long_prefill_token_threshold": 0, "max_model_len": max_len,
            "max_position_embeddings": max_len, "num_spec_tokens": 0,
            "dev_ns": [1000, 0, 0], "host_ns": [0, 0], "max_steps": 64, "requests": reqs,
            # vLLM's tests build the manager without EngineCore's start-up check (a pool that
            # holds one request of max_model_len), and so do these
            "startup_check": False}


COMMON = [i for i in range(3) for _ in range(16)]  # three full blocks of 16
CASES = {
    # test_prefix_caching.py::test_prefill
    "prefill": _case(16, 11, [_req(0, COMMON + [3] * 7), _req(1, COMMON + [3] * 5),
                              _req(2, COMMON + [3] * 6, LATER), _req(3, [99] * 160, 2 * LATER)]),
    # test_prefix_caching.py::test_evict
    "evict": _case(16, 11, [_req(0, list(range(87))), _req(1, list(range(87, 135))),
                            _req(2, list(range(35)), LATER)]),
    # test_prefix_caching.py::test_computed_blocks_not_evicted
    "not_evicted": _case(16, 3, [_req(0, list(range(16))), _req(1, list(range(16, 32))),
                                 _req(2, list(range(32)), LATER)]),
    # test_scheduler.py::test_schedule_partial_requests (its text-only form: create_requests
    # gives request i the prompt [i] * num_tokens)
    "partial": _case(16, 200, [_req(i, [i] * 800) for i in range(3)], budget=1024,
                     max_len=1024),
}


@pytest.fixture(scope="module")
def session():
    """One driver process for the module's cases: its start-up is most of their cost."""
    with VllmSession() as s:
        yield s


@pytest.fixture(scope="module")
def runs(session) -> dict[str, list[dict]]:
    """Each case's objects from the driver: its steps, then its requests report."""
    return {name: list(session.run(case)) for name, case in CASES.items()}


def test_one_process_runs_many_workloads_each_on_a_fresh_scheduler(session, runs):
    """A workload run again in the same driver process, after others, gives the same objects:
    nothing of an earlier run's scheduler, pool or prefix cache carries over."""
    assert list(session.run(CASES["prefill"])) == runs["prefill"]
    assert session.proc is not None and session.runs >= len(CASES) + 1


def test_a_refused_or_failing_workload_leaves_the_session_usable(session, runs):
    """vLLM's start-up refusal and an exception inside vLLM end that workload only: the
    driver answers the next one from the same process."""
    pid = session.proc.pid
    with pytest.raises(ScenarioError, match="cache.num_blocks: vLLM does not start"):
        list(session.run({**CASES["evict"], "startup_check": True, "max_model_len": 8192}))
    bad = {**CASES["evict"], "requests": [{**_req(0, [1, 2]), "prompt": "not a list"}]}
    with pytest.raises(KvsimError, match="vLLM raised on"):
        list(session.run(bad))
    assert list(session.run(CASES["evict"])) == runs["evict"]
    assert session.proc.pid == pid


def _first_row(objs: list[dict], request: int) -> tuple[dict, dict]:
    """(step object, row) of the request's first scheduled step."""
    for o in objs:
        for r in o.get("rows", ()):
            if r["request"] == request:
                return o, r
    raise AssertionError(f"request {request} never scheduled")


def _blocks_hit(objs: list[dict], request: int) -> tuple[list[int], int]:
    row = _first_row(objs, request)[1]
    return row["blocks"], row["hit"]


def test_prefill_block_ids_hits_and_free_order(runs):
    got = {i: _blocks_hit(runs["prefill"], i) for i in range(4)}
    assert got == {0: ([1, 2, 3, 4], 0),
                   1: ([1, 2, 3, 5], 48),  # hit on req 0's blocks while they are in use
                   2: ([1, 2, 3, 5], 48),  # hit on free cached blocks; reuses partial 5
                   # the eviction order: hashless blocks first, then LRU
                   3: ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1], 0)}


def test_evict_order_and_touch(runs):
    objs = runs["evict"]
    assert _blocks_hit(objs, 0) == ([1, 2, 3, 4, 5, 6], 0)
    assert _blocks_hit(objs, 1) == ([7, 8, 9], 0)
    assert _blocks_hit(objs, 2) == ([1, 2, 6], 32)
    assert _first_row(objs, 2)[0]["free"] == 7


def test_computed_blocks_not_evicted(runs):
    objs = runs["not_evicted"]
    assert [_blocks_hit(objs, i) for i in range(3)] == [([1], 0), ([2], 0), ([1, 2], 16)]


def test_schedule_partial_requests(runs):
    first = runs["partial"][0]
    assert {r["request"]: r["q"] for r in first["rows"]} == {0: 800, 1: 224}


def test_every_case_finishes_and_frees_everything(runs):
    for name, objs in runs.items():
        reqs = objs[-1]["requests"]
        assert [r["reason"] for r in reqs] == ["length"] * len(reqs), name
        frees = sum(e[0] == "free" for o in objs for e in o.get("proc_events", ()))
        allocs = sum(e[0] in ("alloc", "reuse") for o in objs
                     for e in o.get("sched_events", ()))
        assert frees == allocs, name


def test_same_step_prefix_hit_is_flagged_by_i5(runs):
    """vLLM hashes a block when its chunk is scheduled, so req 1 hits req 0's blocks in the
    step that writes them. kvsim's I5 (a page written is the writer's alone) flags it;
    docs/vllm.md says why it is harmless in vLLM and what kvsim would have to change."""
    conv = Converter(16, 11, 8192)
    ck = StepChecker({"tokens_per_block": 16, "num_blocks": 11, "null_block": True})
    found = []
    for step, rows, events in conv.steps(runs["prefill"]):
        for e in events:
            if e.phase == "sched":
                found += ck.block_event(e)
        found += ck.launch(step, rows)
        for e in events:
            if e.phase == "proc":
                found += ck.block_event(e)
    found += ck.finish()
    assert [(v.invariant, v.step, v.request) for v in found] == [("I5", 0, 0)]


def test_record_check_metrics_timeline(tmp_path):
    """EAGLE drafts, chunked prefill and preemptions through the real scheduler: the trace
    passes `kvsim check`, and the readers of `kvsim run`'s traces read it."""
    out = tmp_path / "trace"
    r = CliRunner().invoke(app, ["record", "--engine", "vllm", str(HERE / "small.toml"),
                                 "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert '"preemptions": 9' in r.output and '"violations": 0' in r.output
    r = CliRunner().invoke(app, ["check", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["metrics", str(out)])
    assert r.exit_code == 0 and "preemptions" in r.output, r.output
    r = CliRunner().invoke(app, ["timeline", str(out), "--out", str(tmp_path / "t.json")])
    assert r.exit_code == 0, r.output


def test_default_scenario_reprofiled_for_vllm_records_clean(tmp_path):
    """scenarios/default.toml as vLLM can run it: the real engine's decisions break none of
    kvsim's invariants (checked online by StepChecker as the trace is written)."""
    data = tomllib.loads((ROOT / "scenarios" / "default.toml").read_text())
    data["profile"] = "vllm-v1"
    data["cache"]["reuse"] = "full"
    del data["scheduler"]["policy"]
    data["overlap"]["enabled"] = False
    res = record(parse_scenario(data), tmp_path / "trace")
    assert res.violations == []
    assert res.summary["preemptions"] > 0 and res.summary["reused_tokens"] > 0
    assert res.summary["finished"] == res.summary["requests"]


def test_diff_reports_where_the_profile_departs(tmp_path):
    """kvsim's vllm-v1 profile allocates a whole prompt at admission; vLLM allocates per
    chunk: the first divergence is step 1's block tables (request 2's 96-token chunk of a
    longer prompt gets 6 blocks from vLLM), until the profile is rebuilt (issue 54)."""
    r = CliRunner().invoke(app, ["diff", "--engine", "vllm", str(HERE / "small.toml"),
                                 "--json"])
    assert r.exit_code == 1, r.output
    first = json.loads(r.output)["first"]
    assert (first["step"], first["field"]) == (1, "block_tables")
    assert first["vllm"] == {"0": [1, 2, 3], "1": [4, 5, 6, 7], "2": [8, 9, 10]}
    assert len(first["kvsim"]["2"]) > len(first["vllm"]["2"])


def test_recorded_trace_replays_through_the_cpu_reference(tmp_path):
    """The CSR derived from vLLM's block tables reads exactly the K/V each row needs: every
    row of a recorded EAGLE run is `ok` on the CPU reference backend."""
    out = tmp_path / "trace"
    r = CliRunner().invoke(app, ["record", "--engine", "vllm", str(HERE / "tiny.toml"),
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["replay", "--backend", "reference", str(out),
                                 "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    counts = json.loads((tmp_path / "r.json").read_text())["counts"]
    assert counts["ok"] > 0 and sum(counts.values()) == counts["ok"], counts


def test_a_pool_vllm_would_not_start_with_is_refused(tmp_path):
    """EngineCore does not start when one request of max_model_len cannot fit the pool; the
    adapter says so (exit 2, naming the field) instead of recording a run that stalls."""
    text = (HERE / "tiny.toml").read_text().replace("num_blocks = 17", "num_blocks = 16")
    (tmp_path / "s.toml").write_text(text)
    r = CliRunner().invoke(app, ["record", "--engine", "vllm", str(tmp_path / "s.toml"),
                                 "--out", str(tmp_path / "t")])
    assert r.exit_code == 2, r.output
    assert ": cache.num_blocks: vLLM does not start: " in r.output and "needs 16 blocks" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


def test_vllm_asserts_when_the_prefill_threshold_clips_spec_decode_padding(session,
                                                                           tmp_path):
    """A vLLM 0.33.0 bug the fuzzer found (docs/vllm.md): a waiting request with one token
    left, admitted beside a running one, is padded to 1 + k tokens and then clipped by
    long_prefill_token_threshold; schedule() asserts. With the threshold at 1 + k it runs."""
    sc, base = load_scenario(HERE / "spec_pad_clip.toml")
    with pytest.raises(KvsimError, match="AssertionError at vllm/v1/core/sched/scheduler.py:"
                                         r"\d+ in schedule"):
        record(sc, tmp_path / "t", base, session=session)
    ok = sc.model_copy(update={"scheduler": sc.scheduler.model_copy(update={"chunk_size": 2})})
    assert record(ok, tmp_path / "ok", base, session=session).violations == []
    assert not (tmp_path / "t").exists()
