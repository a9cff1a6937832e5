"""What `kvsim run`, `check` and `--version` print: the real CLI on small scenarios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.cli import app

ROOT = Path(__file__).parents[2]
WORKED = str(ROOT / "scenarios" / "worked_example.toml")


def kvsim(*argv: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, list(argv))


def test_check_lists_a_steps_violations_in_causal_order(tmp_path) -> None:
    """Regression: check sorted a step's violations as strings (I10, I11, I12, ...), so the
    worked example's root cause, I12, came third. It comes first, in run's order."""
    trace = str(tmp_path / "t")
    ran = kvsim("run", WORKED, "--profile", "trtllm-pre-17264", "--out", trace, "--json")
    checked = kvsim("check", trace, "--json")
    assert (ran.exit_code, checked.exit_code) == (1, 1)
    run_v, check_v = json.loads(ran.output)["violations"], json.loads(checked.output)["violations"]
    assert check_v[0]["invariant"] == "I12" and check_v[0]["step"] == 1
    assert [v["invariant"] for v in check_v if v["step"] == 1][:4] == ["I12", "I3", "I3", "I4"]
    assert check_v == run_v
    text = kvsim("check", trace).output.splitlines()
    assert text[0].startswith("I12 step 1 req 0:")


def test_run_and_check_json_have_one_shape(tmp_path) -> None:
    trace = str(tmp_path / "t")
    ran = json.loads(kvsim("run", WORKED, "--out", trace, "--json").output)
    checked = json.loads(kvsim("check", trace, "--json").output)
    assert list(ran) == list(checked) == ["command", "source", "summary", "violations"]
    assert (ran["command"], ran["source"]) == ("run", WORKED)
    assert (checked["command"], checked["source"]) == ("check", trace)
    assert set(ran["summary"]) == set(checked["summary"])
    assert ran["summary"] == checked["summary"] and ran["violations"] == [] == checked["violations"]


def test_run_shows_latency_throughput_and_the_engine(tmp_path) -> None:
    ran = kvsim("run", WORKED, "--json")
    s = json.loads(ran.output)["summary"]
    assert (s["engine"], s["profile"]) == ("reference", "trtllm-post-17264")
    trace = tmp_path / "t"
    kvsim("run", WORKED, "--out", str(trace))
    m = json.loads(kvsim("metrics", str(trace), "--json").output)
    for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "throughput_rps",
              "output_tps"):
        assert s[k] == pytest.approx(m[k]), k
    text = kvsim("run", WORKED).output
    assert "reference · profile trtllm-post-17264" in text
    assert f"TTFT p50 / p99 │ {s['ttft_p50_ms']:,.2f} / {s['ttft_p99_ms']:,.2f} ms" in text
    assert f"{s['throughput_rps']:,.2f} req/s" in text


def test_fast_engine_is_named(tmp_path) -> None:
    sc = tmp_path / "s.toml"
    sc.write_text("[spec]\nmode = \"none\"\n[overlap]\nenabled = false\n[cache]\nreuse = \"off\"\n"
                  "[workload.synthetic]\nnum_requests = 4\nqps = 10.0\n"
                  "prompt_len = { kind = \"constant\", value = 40 }\n"
                  "output_len = { kind = \"constant\", value = 5 }\n")
    s = json.loads(kvsim("run", str(sc), "--json", "--engine", "fast").output)["summary"]
    ref = json.loads(kvsim("run", str(sc), "--json", "--engine", "reference").output)["summary"]
    assert (s["engine"], ref["engine"]) == ("fast", "reference")
    assert {k: v for k, v in s.items() if k != "engine"} == \
        {k: v for k, v in ref.items() if k != "engine"}


def test_version_names_the_package_and_the_trace_format() -> None:
    from importlib.metadata import version

    from sim.trace.records import FORMAT_VERSION

    r = kvsim("--version")
    assert r.exit_code == 0
    assert r.output == f"kvsim {version('kvsim')} (trace format {FORMAT_VERSION}; reads 1, 2, 3)\n"


@pytest.mark.parametrize(("argv", "line"), [
    (["run", WORKED, "--engine", "quick"],
     "error: kvsim run: Invalid value for '--engine': 'quick' is not one of 'auto', 'fast', "
     "'reference'. (see kvsim run --help)"),
    (["replay", ".", "--backend", "gpu"],
     "error: kvsim replay: Invalid value for '--backend': 'gpu' is not one of 'flashinfer', "
     "'reference'. (see kvsim replay --help)"),
    (["run", WORKED, "--bogus"],
     "error: kvsim run: No such option: --bogus (Possible options: --out) "
     "(see kvsim run --help)"),
    (["run"], "error: kvsim run: Missing argument 'scenario'. (see kvsim run --help)"),
    (["frobnicate"], "error: kvsim: No such command 'frobnicate'. (see kvsim --help)")])
def test_usage_errors_are_one_line_exit_2(argv, line) -> None:
    r = kvsim(*argv)
    assert (r.exit_code, r.output) == (2, line + "\n")


def test_closed_choices_are_listed_in_help() -> None:
    assert "auto|fast|reference" in kvsim("run", "--help").output
    replay = kvsim("replay", "--help").output
    assert "flashinfer|refere" in replay and "incremental|full" in replay


def test_nothing_to_measure_is_null_not_nan(tmp_path) -> None:
    """One request with one output has no TPOT: the summary (and the manifest, JSON) says
    null, the table '-'; NaN made the engines' summaries unequal and the manifest not JSON."""
    sc = tmp_path / "s.toml"
    sc.write_text('[workload]\nrequests = [{ arrival_ns = 0, prompt_len = 4, output_len = 1 }]\n')
    out = json.loads(kvsim("run", str(sc), "--json", "--out", str(tmp_path / "t")).output)
    assert out["summary"]["tpot_p50_ms"] is None and out["summary"]["ttft_p50_ms"] > 0
    manifest = (tmp_path / "t" / "manifest.json").read_text()
    assert "NaN" not in manifest and json.loads(manifest)["summary"]["tpot_p99_ms"] is None
    assert "TPOT p50 / p99 │ - / - ms" in kvsim("run", str(sc)).output


def test_fuzz_ignore_choices_are_the_registry_s_invariants() -> None:
    from sim.check.registry import INVARIANTS
    from sim.cli.choices import Ignorable

    assert [i.value for i in Ignorable] == [*INVARIANTS, "LIVENESS", "HOST", "hang", "crash"]
    r = kvsim("fuzz", "--profile", "trtllm-post-17264", "--ignore", "I99")
    assert r.exit_code == 2 and r.output.startswith(
        "error: kvsim fuzz: Invalid value for '--ignore': 'I99' is not one of 'I1',")


def test_metrics_block_shows_every_statistic() -> None:
    from sim.cli import metrics_cmd
    from sim.metrics import STATS

    assert metrics_cmd.STATS == STATS
