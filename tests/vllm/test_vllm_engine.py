"""The vLLM adapter against vLLM 0.33.0 itself (sim/engines/vllm*.py, `kvsim record`).

The cases below are vLLM's own tests (tests/v1/core/test_prefix_caching.py and
test_scheduler.py), driven through the real Scheduler step by step instead of through
KVCacheManager calls: the block ids, hit lengths and free counts they pin are vLLM's. They run
in one driver process (its start-up is most of the cost). Skipped only where .venv-vllm is
absent; `make test` builds it.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner
from vllm_cases import CASES, _blocks_hit, _first_row, _req
from vllm_workloads import generated

from sim.check import StepChecker
from sim.cli import app
from sim.config import load_scenario, parse_scenario
from sim.engines.record import record
from sim.engines.vllm import VllmSession, payload, refuse_unsupported, vllm_python
from sim.engines.vllm_trace import Converter
from sim.errors import KvsimError, ScenarioError
from sim.vllm_engine import VllmRun

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason="no .venv-vllm (make vllm-env)")

GENERATED = int(os.environ.get("KVSIM_VLLM_WORKLOADS", "100"))


def _scenario_payload(path: Path) -> dict:
    sc, base = load_scenario(path)
    refuse_unsupported(sc, str(path))
    return payload(sc, base, where=path.name)


def _generated_payloads(n: int) -> dict[str, dict]:
    out = {}
    for i, d in enumerate(generated(n)):
        where = f"generated #{i}"
        sc = parse_scenario(d, where)
        refuse_unsupported(sc, where)
        out[where] = payload(sc, where=where)
    return out


@pytest.fixture(scope="module")
def session():
    """One driver process for the module's cases: its start-up is most of their cost."""
    with VllmSession() as s:
        yield s


@pytest.fixture(scope="module")
def real(session) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (payload, the driver's objects: its steps, then its requests report) for every
    payload these tests run on vLLM, in one driver process (its start-up is most of the cost):
    vLLM's test cases, the shipped vLLM scenarios and the generated workloads."""
    ps = {name: dict(p, where=name) for name, p in CASES.items()}
    for path in (HERE / "small.toml", HERE / "tiny.toml", ROOT / "scenarios" / "vllm.toml"):
        ps[path.name] = _scenario_payload(path)
    ps |= _generated_payloads(GENERATED)
    return {name: (p, list(session.run(p))) for name, p in ps.items()}


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


@pytest.fixture(scope="module")
def runs(real) -> dict[str, list[dict]]:
    """Each of vLLM's test cases' objects from the driver."""
    return {name: real[name][1] for name in CASES}


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


def test_reset_prefix_cache(runs):
    assert [_blocks_hit(runs["reset"], i)[1] for i in range(4)] == [0, 0, 48, 0]


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


def test_diff_finds_no_divergence_on_the_small_scenario():
    """kvsim's vllm-v1 profile against vLLM, every field of every step (`--all`)."""
    r = CliRunner().invoke(app, ["diff", "--engine", "vllm", str(HERE / "small.toml"),
                                 "--all", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["first"] is None and res["tally"] == {} and res["steps"][0] == res["steps"][1]


def _norm(o: dict) -> dict:
    """A step object with its block hashes zeroed (vLLM's are sha256 of its own encoding;
    the model's are kvsim's): everything else must match exactly."""
    o = json.loads(json.dumps(o))
    for key in ("sched_events", "proc_events", "events"):
        for e in o.get(key, ()):
            e[5] = 0
    return o


def _mismatches(real: dict[str, tuple[dict, list[dict]]], names: list[str]) -> list[str]:
    """The payloads among `names` whose step objects differ between vLLM and the model, with
    the first object and keys that differ."""
    bad = []
    for name in names:
        p, objs = real[name]
        want = [_norm(o) for o in objs]
        got = [_norm(o) for o in VllmRun(p).run()]
        if got != want:
            bad.append(f"{name}: {_first_difference(got, want)}")
    return bad


def _first_difference(got: list[dict], want: list[dict]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"object {i} differs in {sorted(k for k in b if a.get(k) != b[k])}"
    return f"{len(got)} objects, vLLM {len(want)}"


def test_the_profile_is_vllm_on_the_shipped_and_the_vllm_cases(real):
    """Step for step (rows, block tables, block events in the pool's order, free and cached
    counts, preemptions, accepted drafts, the requests report): small.toml, tiny.toml, the
    default workload as vLLM runs it (scenarios/vllm.toml) and vLLM's own test cases."""
    names = [*CASES, "small.toml", "tiny.toml", "vllm.toml"]
    assert _mismatches(real, names) == []


def test_the_profile_is_vllm_on_generated_workloads(real):
    """Hypothesis-generated workloads (tests/vllm/vllm_workloads.py: chunked prefill, shared
    prefixes, preemption pressure, EAGLE k = 1-4, budgets, prefix-cache resets), seeded;
    KVSIM_VLLM_WORKLOADS sets how many (docs/vllm.md gives the figure)."""
    names = [n for n in real if n.startswith("generated #")]
    assert len(names) == GENERATED and _mismatches(real, names) == []


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


def test_a_padded_step_cut_by_the_threshold_fails_vllms_assertion(session, tmp_path):
    """docs/vllm.md: vLLM 0.33.0 asserts when long_prefill_token_threshold cuts a request
    padded to a speculative step. The adapter refuses the threshold (exit 2); on vLLM itself,
    that refusal bypassed, the engine fails the assertion."""
    path = HERE / "padded_step_assert.toml"
    r = CliRunner().invoke(app, ["record", "--engine", "vllm", str(path),
                                 "--out", str(tmp_path / "t")])
    assert r.exit_code == 2 and ": scheduler.chunk_size: vLLM 0.33.0 fails an assertion" in r.output
    sc, base = load_scenario(path)
    with pytest.raises(KvsimError, match=r"AssertionError at vllm/v1/core/sched/scheduler.py:"
                                         r"\d+ in schedule"):
        list(session.run(payload(sc, base)))
