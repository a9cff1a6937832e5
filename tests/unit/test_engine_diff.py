"""`kvsim diff`'s comparison (sim/engines/diff.py) on per-step fields, without vLLM."""

from __future__ import annotations

from typer.testing import CliRunner

from sim.cli import app
from sim.engines.diff import FIELDS, compare


def _step(**changes: object) -> dict:
    base: dict = {"scheduled": [(0, 16)], "prefix_hit": {0: 0}, "preempted": [],
                  "block_tables": {0: [1]}, "free": (9, 0), "finished": [], "accepted": {}}
    return {**base, **changes}


def test_identical_runs_do_not_diverge():
    res = compare([_step(), _step()], [_step(), _step()], every=True)
    assert res.first is None and res.tally == {} and res.steps == (2, 2)


def test_the_first_field_in_order_is_reported():
    ours = [_step(), _step(free=(8, 0), scheduled=[(0, 1)])]
    real = [_step(), _step(free=(7, 1), scheduled=[(0, 2)])]
    res = compare(ours, real, every=False)
    assert res.first is not None
    assert (res.first.step, res.first.field, res.first.kvsim, res.first.vllm) == (
        1, "scheduled", [(0, 1)], [(0, 2)])
    assert FIELDS.index("scheduled") < FIELDS.index("free")


def test_all_tallies_every_step_and_a_missing_step_counts():
    ours = [_step(free=(1, 0)), _step(free=(1, 0)), _step()]
    real = [_step(), _step()]
    res = compare(ours, real, every=True)
    # free differs at steps 0 and 1; step 2, which only kvsim ran, differs in every field
    assert res.tally == {**dict.fromkeys(FIELDS, 1), "free": 3}
    assert res.first_by_field["free"] == 0 and res.first_by_field["scheduled"] == 2


def test_stops_at_the_first_divergent_step_without_all():
    res = compare([_step(free=(1, 0)), _step(free=(2, 0))], [_step(), _step()], every=False)
    assert res.tally == {"free": 1}


def test_diff_refuses_what_vllm_cannot_run(tmp_path):
    sc = tmp_path / "s.toml"
    sc.write_text('profile = "trtllm-pre-17264"\n[workload.synthetic]\nnum_requests = 1\n'
                  'arrival = "poisson"\nqps = 1.0\n'
                  'prompt_len = { kind = "uniform", min = 8, max = 8 }\n'
                  'output_len = { kind = "uniform", min = 2, max = 2 }\n')
    r = CliRunner().invoke(app, ["diff", "--engine", "vllm", str(sc)])
    assert r.exit_code == 2 and ": profile: " in r.output and "Traceback" not in r.output
