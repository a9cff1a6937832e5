"""The bad-input contract over a generated corpus: exit 2, one message naming the file and the
field, no traceback, nothing written. Most cases run in-process (CliRunner); a sample runs as
real subprocesses to prove no traceback reaches a terminal."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sim.api import parse_scenario, run
from tests.hardening.corpus import (
    BASE,
    Case,
    scenario_mutations,
    trace_mutations,
    trace_scenario,
    workload_mutations,
)
from tests.hardening.harness import invoke, problems


@pytest.fixture(scope="module")
def valid_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("valid") / "trace"
    run(parse_scenario(BASE), out=out)
    return out


def scenario_cases(root: Path) -> list[Case]:
    root.mkdir(parents=True, exist_ok=True)
    cases = []
    for i, (name, data, fld) in enumerate(scenario_mutations()):
        f = root / f"s{i}.toml"
        cases.append(Case(name, ["run", str(f), "--out", str(root / f"out{i}")],
                          [str(f), fld], root / f"out{i}", {str(f): data}))
    return cases


def workload_cases(root: Path) -> list[Case]:
    root.mkdir(parents=True, exist_ok=True)
    cases = []
    for i, (name, fmt, data, fld) in enumerate(workload_mutations()):
        t, f = root / f"w{i}.trace", root / f"w{i}.toml"
        cases.append(Case(name, ["run", str(f), "--out", str(root / f"out{i}")],
                          [str(t), fld], root / f"out{i}",
                          {str(t): data, str(f): trace_scenario(t, fmt)}))
    return cases


def trace_cases(root: Path, valid: Path) -> list[Case]:
    cases = []
    for i, (name, mutate, fld) in enumerate(trace_mutations()):
        d = root / f"t{i}" / "trace"
        shutil.copytree(valid, d)
        mutate(d)
        tl = root / f"t{i}" / "timeline.json"
        for argv in (["check", str(d)], ["metrics", str(d)],
                     ["timeline", str(d), "--out", str(tl)]):
            cases.append(Case(f"{argv[0]}:{name}", argv, [str(d), fld],
                              tl if argv[0] == "timeline" else None))
    return cases


def _run_all(cases: list[Case]) -> list[str]:
    for c in cases:
        for f, data in c.files.items():
            Path(f).write_bytes(data)
    failures = []
    for c in cases:
        code, out = invoke(c.argv)
        bad = problems(c, code, out)
        if bad:
            failures.append(f"{c.name}: {', '.join(bad)}\n    {out.strip()[:300]}")
    return failures


def test_scenario_corpus(tmp_path: Path) -> None:
    cases = scenario_cases(tmp_path)
    assert len(cases) >= 120
    assert _run_all(cases) == []


def test_workload_trace_corpus(tmp_path: Path) -> None:
    cases = workload_cases(tmp_path)
    assert len(cases) >= 30
    assert _run_all(cases) == []


def test_kvsim_trace_corpus(tmp_path: Path, valid_trace: Path) -> None:
    cases = trace_cases(tmp_path, valid_trace)
    assert len(cases) >= 150
    assert _run_all(cases) == []


def test_stale_temp_dir_is_refused(tmp_path: Path, valid_trace: Path) -> None:
    """A SIGKILLed writer can leave DIR.tmp-<pid> with a finished manifest: never a trace."""
    stale = tmp_path / "trace.tmp-999999"
    shutil.copytree(valid_trace, stale)
    case = Case("stale", ["check", str(stale)], [str(stale), "temporary"])
    code, out = invoke(case.argv)
    assert problems(case, code, out) == []


KVSIM = [sys.executable, "-c", "from sim.cli import main; main()"]


def test_subprocess_sample(tmp_path: Path, valid_trace: Path) -> None:
    """A sample of every kind through a real process: what a terminal would show."""
    cases = scenario_cases(tmp_path / "s")[::25] + workload_cases(tmp_path / "w")[::10] + \
        trace_cases(tmp_path / "t", valid_trace)[::37]
    for c in cases:
        for f, data in c.files.items():
            Path(f).parent.mkdir(parents=True, exist_ok=True)
            Path(f).write_bytes(data)
    assert len(cases) >= 12
    for c in cases:
        r = subprocess.run(KVSIM + c.argv, capture_output=True, text=True, timeout=60)
        assert problems(c, r.returncode, r.stdout + r.stderr) == [], (c.name, r.stderr)
