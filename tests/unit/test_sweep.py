"""Sweeps: grid expansion, validation errors, content-hash caching and resume, the QPS search."""

from __future__ import annotations

import sys

import pyarrow.parquet as pq
import pytest

from sim.errors import ScenarioError
from sim.sweep.cache import ResultCache, content_key
from sim.sweep.spec import SweepSpec, load_sweep, set_path

try:
    import sim.api  # noqa: F401

    HAVE_API = True
except ImportError:
    HAVE_API = False
needs_api = pytest.mark.skipif(not HAVE_API, reason="sim.api (engine, workload) not importable")

BASE = """
seed = 3
[cache]
tokens_per_block = 16
num_blocks = 200
[scheduler]
max_batch_size = 8
[spec]
mode = "mtp"
max_draft_len = 2
acceptance = { kind = "rates", rates = [0.8, 0.5] }
[limits]
max_seq_len = 1024
[workload.synthetic]
num_requests = 12
qps = 20.0
prompt_len = { kind = "uniform", min = 20, max = 80 }
output_len = { kind = "uniform", min = 4, max = 16 }
[cost]
step_base_ns = 1_000_000
host_base_ns = 500_000
"""


def write(tmp_path, grid: str, extra: str = "") -> tuple[SweepSpec, object]:
    (tmp_path / "base.toml").write_text(BASE)
    (tmp_path / "s.toml").write_text(f'base = "base.toml"\n{extra}\n[grid]\n{grid}\n')
    return load_sweep(tmp_path / "s.toml")


def test_points_in_file_order(tmp_path) -> None:
    spec, base = write(tmp_path, '"spec.max_draft_len" = [1, 2]\n"overlap.enabled" = [true, false]')
    assert base == (tmp_path / "base.toml").resolve()
    assert spec.points() == [
        {"spec.max_draft_len": 1, "overlap.enabled": True},
        {"spec.max_draft_len": 1, "overlap.enabled": False},
        {"spec.max_draft_len": 2, "overlap.enabled": True},
        {"spec.max_draft_len": 2, "overlap.enabled": False}]


def test_sweep_file_errors_name_the_field(tmp_path) -> None:
    with pytest.raises(ScenarioError, match=r"s.toml: grid.spec.max_draft_len: needs at least"):
        write(tmp_path, '"spec.max_draft_len" = []')
    with pytest.raises(ScenarioError, match=r"s.toml: search: Value|slo: a search needs"):
        write(tmp_path, '"overlap.enabled" = [true]', "[search]\nlo = 1.0")
    with pytest.raises(ScenarioError, match="cannot read sweep"):
        load_sweep(tmp_path / "missing.toml")


def test_set_path() -> None:
    d = {"spec": {"max_draft_len": 1}}
    set_path(d, "spec.max_draft_len", 3, "x")
    assert d == {"spec": {"max_draft_len": 3}}
    set_path(d, "cache.num_blocks", 9, "x")
    assert d == {"spec": {"max_draft_len": 3}, "cache": {"num_blocks": 9}}
    with pytest.raises(ScenarioError, match="grid.spec.max_draft_len.x: spec.max_draft_len is a"):
        set_path(d, "spec.max_draft_len.x", 1, "x")


def test_cache_is_content_addressed_and_atomic(tmp_path) -> None:
    k1 = content_key({"a": 1, "b": {"c": 2}}, "0.1.0", "/x")
    assert k1 == content_key({"b": {"c": 2}, "a": 1}, "0.1.0", "/x")  # key order is irrelevant
    assert k1 != content_key({"a": 1, "b": {"c": 2}}, "0.1.1", "/x")  # a new version reruns
    c = ResultCache(tmp_path)
    assert c.get(k1) is None
    c.put(k1, {"x": 1.5})
    assert c.get(k1) == {"x": 1.5}
    assert [p.name for p in c.path(k1).parent.iterdir()] == [f"{k1}.json"]


@needs_api
def test_run_delete_one_rerun_recomputes_one(tmp_path) -> None:
    from sim.sweep import run_sweep

    spec, base = write(tmp_path, '"spec.max_draft_len" = [1, 2]\n"overlap.enabled" = [true, false]')
    out = tmp_path / "out"
    first = run_sweep(spec, base, out, workers=1)
    assert (first.computed, first.cached) == (4, 0)
    table = pq.read_table(out / "results.parquet")
    assert table.column("grid.spec.max_draft_len").to_pylist() == [1, 1, 2, 2]
    assert all(v > 0 for v in table.column("throughput_rps").to_pylist())
    entries = sorted((out / "cache").glob("*/*.json"))
    assert len(entries) == 4
    entries[2].unlink()
    again = run_sweep(spec, base, out, workers=2)  # spawn pool: tasks must pickle
    assert (again.computed, again.cached) == (1, 3)
    assert pq.read_table(out / "results.parquet").equals(table)


@needs_api
def test_an_edited_workload_trace_is_not_a_cache_hit(tmp_path) -> None:
    """The cache key holds the trace file's bytes: same path, new contents, new results."""
    from sim.sweep import run_sweep

    trace = tmp_path / "t.csv"
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    trace.write_text(head + "".join(f"2023-11-16 18:15:{i:02d}.0000000,{40 + i},8\n"
                                    for i in range(10)))
    base = BASE.split("[workload.synthetic]")[0] + (
        '[workload.trace]\npath = "t.csv"\nformat = "azure2023"\n[cost]\n')
    (tmp_path / "base.toml").write_text(base)
    (tmp_path / "s.toml").write_text('base = "base.toml"\n[grid]\n'
                                     '"scheduler.max_batch_size" = [2, 8]\n')
    spec, sc = load_sweep(tmp_path / "s.toml")
    first = run_sweep(spec, sc, tmp_path / "out", workers=1)
    assert (first.computed, first.cached) == (2, 0)
    trace.write_text(head + "".join(f"2023-11-16 18:15:{i:02d}.0000000,{400 + i},8\n"
                                    for i in range(10)))
    again = run_sweep(spec, sc, tmp_path / "out", workers=1)
    assert (again.computed, again.cached) == (2, 0)
    assert again.results.column("requests").to_pylist() == [10, 10]
    unchanged = run_sweep(spec, sc, tmp_path / "out", workers=1)
    assert (unchanged.computed, unchanged.cached) == (0, 2)


@needs_api
def test_grid_value_errors_name_the_point(tmp_path) -> None:
    from sim.sweep import run_sweep

    spec, base = write(tmp_path, '"spec.max_draft_len" = [1, 999]')
    with pytest.raises(ScenarioError, match=r"spec.max_draft_len=999.*spec.max_draft_len"):
        run_sweep(spec, base, tmp_path / "out", workers=1)
    assert not (tmp_path / "out" / "results.parquet").exists()


@needs_api
def test_search_brackets_max_qps(tmp_path) -> None:
    from sim.sweep import run_sweep

    search = "[slo]\nttft_p99_ms = 6\n[search]\nlo = 0.5\nhi = 500.0\niters = 4"
    spec, base = write(tmp_path, '"overlap.enabled" = [true, false]', search)
    res = run_sweep(spec, base, tmp_path / "out", workers=1)
    rows = res.results.to_pylist()
    for r in rows:
        assert 0.5 <= r["max_qps"] < 500.0 and r["ttft_p99_ms"] <= 6
    assert res.computed == 2 * (2 + 4)  # both ends, then 4 bisection steps per point
    rerun = run_sweep(spec, base, tmp_path / "out", workers=1)
    assert rerun.computed == 0 and rerun.results.equals(res.results)


@needs_api
def test_points_are_capacity_runs_no_checker_no_trace(tmp_path, monkeypatch) -> None:
    import sim.api
    from sim.sweep import run_sweep

    seen: list[tuple[bool, object]] = []
    real = sim.api.run

    def spy(sc, **kw):  # type: ignore[no-untyped-def]
        seen.append((kw.get("check", True), kw.get("out")))
        return real(sc, **kw)

    monkeypatch.setattr(sim.api, "run", spy)
    spec, base = write(tmp_path, '"overlap.enabled" = [true, false]')
    run_sweep(spec, base, tmp_path / "out", workers=1)
    assert seen == [(False, None), (False, None)]


def test_plot_leaves_the_matplotlib_backend_alone(tmp_path) -> None:
    mpl = pytest.importorskip("matplotlib")
    import pyarrow as pa

    from sim.sweep.plot import plot_sweep

    before = mpl.get_backend()
    mpl.use("svg")  # a notebook's inline backend stands in: plotting must not switch it to Agg
    try:
        spec = SweepSpec.model_validate({"base": "b.toml",
                                         "grid": {"spec.max_draft_len": [1, 2]}})
        table = pa.table({"grid.spec.max_draft_len": [1, 2], "throughput_rps": [1.0, 2.0]})
        assert plot_sweep(table, spec, tmp_path / "s.png") == tmp_path / "s.png"
        assert (tmp_path / "s.png").stat().st_size > 0 and mpl.get_backend() == "svg"
    finally:
        mpl.use(before)


@needs_api
def test_without_matplotlib_the_sweep_says_no_plot(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from sim.cli import app
    from sim.sweep.plot import NO_PLOT

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    write(tmp_path, '"overlap.enabled" = [true]')
    r = CliRunner().invoke(app, ["sweep", str(tmp_path / "s.toml"), "--out",
                                 str(tmp_path / "out"), "--workers", "1"])
    assert r.exit_code == 0, r.output
    assert r.stderr.strip() == NO_PLOT == ("no plot: matplotlib is not installed "
                                           "(pip install 'kvsim[plot]')")
    assert "sweep.png" not in r.stdout and not (tmp_path / "out" / "sweep.png").exists()


@pytest.mark.parametrize(("slo", "field"), [
    ("ttft_p95_ms = 5", "slo.ttft_p95_ms: <metric>_<stat>_ms with metric ttft, tpot, itl, e2e"),
    ("latency_p99_ms = 5", "slo.latency_p99_ms: <metric>_<stat>_ms"),
    ("itl_mean_ms = 0", "slo.itl_mean_ms: a bound in ms, a finite number > 0 .got 0."),
    ("e2e_p50_ms = true", "slo.e2e_p50_ms: a bound in ms"),
    ("tpot_p90_ms = nan", "slo.tpot_p90_ms: a bound in ms")])
def test_slo_names_the_bad_field(tmp_path, slo, field) -> None:
    with pytest.raises(ScenarioError, match=rf"s.toml: {field}"):
        write(tmp_path, '"overlap.enabled" = [true]', f"[slo]\n{slo}")


def test_slo_by_metric_and_statistic(tmp_path) -> None:
    spec, _ = write(tmp_path, '"overlap.enabled" = [true]',
                    "[slo]\nitl_p90_ms = 5\ne2e_mean_ms = 300\nttft_p99_ms = 500")
    assert [t.key for t in spec.slo.targets()] == ["itl_p90_ms", "e2e_mean_ms", "ttft_p99_ms"]
    assert str(spec.slo) == "ITL p90 ≤ 5 ms, E2E mean ≤ 300 ms, TTFT p99 ≤ 500 ms"


def test_the_shipped_sweep_files_still_load() -> None:
    from pathlib import Path

    for f in sorted((Path(__file__).parents[2] / "sweeps").glob("*.toml")):
        if "[grid]" in f.read_text():  # a sweep, not one of its base scenarios
            spec, _ = load_sweep(f)
            assert [t.key for t in spec.slo.targets()] == ["ttft_p99_ms", "tpot_p99_ms"]


@needs_api
def test_sweep_cli_prints_max_qps_per_point(tmp_path) -> None:
    from typer.testing import CliRunner

    from sim.cli import app

    search = "[slo]\nttft_p99_ms = 6\nitl_p90_ms = 50\n[search]\nlo = 0.5\nhi = 500.0\niters = 2"
    write(tmp_path, '"overlap.enabled" = [true, false]', search)
    r = CliRunner().invoke(app, ["sweep", str(tmp_path / "s.toml"), "--out",
                                 str(tmp_path / "out"), "--workers", "1"])
    assert r.exit_code == 0, r.output
    rows = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    lines = r.output.splitlines()
    assert "max QPS under SLO · TTFT p99 ≤ 6 ms, ITL p90 ≤ 50 ms" in r.output
    assert "ITL p90" in r.output and "TTFT p99" in r.output
    for row, flag in zip(rows, ("True", "False"), strict=True):
        line = next(x for x in lines if f"│ {flag} " in x)
        assert f"{row['max_qps']:,.2f}" in line and f"{row['itl_p90_ms']:,.2f}" in line
    assert lines[-2].startswith(f"{tmp_path / 'out' / 'results.parquet'}: 2 points")
