"""`kvsim fuzz --engine vllm` on CI: a hundred hypothesis workloads through vLLM 0.33.0's real
scheduler and kvsim's vllm-v1 profile, in one driver process (make test builds .venv-vllm).

What must hold today: every workload runs in vLLM (nothing refused, no crash) and the only
kvsim invariant real vLLM breaks is I5 on same-step prefix hits (docs/vllm.md). What the
profile matches vLLM: no workload diverges.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.engines.vllm import vllm_python
from sim.fuzz.vllm_campaign import VllmCampaign
from sim.fuzz.vllm_report import counts, report, write_report

pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason="no .venv-vllm (make vllm-env)")
CI_WORKLOADS = 100
runner = CliRunner()


@pytest.fixture(scope="module")
def tally():
    t, shrunk = VllmCampaign(seed=0, examples=CI_WORKLOADS, shrink=False).run()
    assert shrunk == []
    return t


def test_every_workload_runs_in_real_vllm(tally):
    assert tally.workloads == CI_WORKLOADS
    assert tally.refused == 0 and "vllm" not in tally.crashes


def test_real_vllm_breaks_only_the_written_up_invariant(tally):
    assert set(tally.violations) <= {"I5"}, tally.violations


def test_the_vllm_v1_profile_matches_vllm_on_every_workload(tally):
    assert (dict(tally.diverged), dict(tally.differs), dict(tally.crashes)) == ({}, {}, {})


def test_a_finding_shrinks_to_a_scenario_that_reproduces_it(tmp_path):
    """The campaign's shrunk scenario is a file `kvsim record --engine vllm` reads, and real
    vLLM breaks the same invariant there (I5 on a same-step prefix hit: docs/vllm.md)."""
    c = VllmCampaign(seed=0, examples=25, shrink_s=20.0, ignore=frozenset({"crash"}))
    tally, shrunk = c.run()
    cls = c.findings(tally)[0]
    assert [s.cls for s in shrunk][:1] == [cls] and cls == "I5"
    again, _ = VllmCampaign(seed=0, examples=25, shrink=False).run()  # seeded: the same counts
    assert {**counts(again), "elapsed_s": 0} == {**counts(tally), "elapsed_s": 0}
    rep = report(tally, shrunk, 0, 25, tmp_path / "out")
    write_report(rep, shrunk, tmp_path / "out")
    path = tmp_path / "out" / rep["shrunk"][0]["scenario"].rsplit("/", 1)[1]
    res = runner.invoke(app, ["record", "--engine", "vllm", str(path), "--out",
                              str(tmp_path / "t"), "--json"])
    assert res.exit_code == 1, res.output
    assert "I5" in {v["invariant"] for v in json.loads(res.output)["violations"]}


def test_cli_counts_and_json_within_the_budget(tmp_path):
    """--budget ends the search before --examples (each workload takes far more than a
    millisecond here), and --json reports what ran."""
    res = runner.invoke(app, ["fuzz", "--engine", "vllm", "--examples", "100000", "--budget",
                              "3", "--no-shrink", "--seed", "1", "--json",
                              "--out", str(tmp_path / "o")])
    assert res.exit_code in (0, 1), res.output
    rep = json.loads(res.output)
    assert (rep["engine"], rep["examples"], rep["shrunk"]) == ("vllm", 100000, [])
    assert 1 <= rep["workloads"] < 100000
    assert res.exit_code == (0 if rep["clean"] == rep["workloads"] else 1)
    assert not (tmp_path / "o").exists()  # nothing shrunk, nothing written
