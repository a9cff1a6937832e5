"""Corrupted traces with a recomputed digest (tests/hardening/trace_corpus.py) x every command
that reads a trace: exit 2, one line naming the file and the column, no traceback, nothing
written, each within a time bound; a sample through real processes, replay included."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.api import parse_scenario, run
from sim.trace.reader import read_trace
from tests.hardening.corpus import BASE, Case
from tests.hardening.harness import invoke, problems
from tests.hardening.trace_corpus import trace_mutations

SECONDS = 10  # the bad-input contract's bound per case
PEAK_RSS = 1536 << 20  # ... and on memory, for this whole process (so for every case)
KVSIM = [sys.executable, "-c", "from sim.cli import main; main()"]


@pytest.fixture(scope="module")
def valid_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("valid") / "trace"
    run(parse_scenario(BASE), out=out)
    return out


def _model(trace: Path) -> dict:
    return dict(json.loads((trace / "manifest.json").read_text())["model"])


def trace_cases(root: Path, valid: Path) -> list[Case]:
    cases = []
    for i, (name, mutate, file, fld) in enumerate(trace_mutations(_model(valid))):
        d = root / f"t{i}" / "trace"
        shutil.copytree(valid, d)
        mutate(d)
        tl = root / f"t{i}" / "timeline.json"
        for argv in (["check", str(d)], ["metrics", str(d)],
                     ["timeline", str(d), "--out", str(tl)]):
            cases.append(Case(f"{argv[0]}:{name}", argv, [str(d / file), fld],
                              tl if argv[0] == "timeline" else None))
    return cases


def test_the_valid_trace_reads(valid_trace: Path) -> None:
    """The corpus's cases fail because of their one mutation, not the base."""
    assert read_trace(valid_trace).tables["rows"].num_rows > 0


def test_corrupted_traces_are_refused(tmp_path: Path, valid_trace: Path) -> None:
    cases = trace_cases(tmp_path, valid_trace)
    assert len(cases) >= 300
    failures = []
    for c in cases:
        t0 = time.perf_counter()
        code, out = invoke(c.argv)
        took = time.perf_counter() - t0
        bad = problems(c, code, out) + ([f"took {took:.1f} s"] if took > SECONDS else [])
        if bad:
            failures.append(f"{c.name}: {', '.join(bad)}\n    {out.strip()[:300]}")
    assert failures == []
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < PEAK_RSS


def test_subprocess_sample(tmp_path: Path, valid_trace: Path) -> None:
    """What a terminal shows, `replay` included (its CPU reference backend)."""
    cases = trace_cases(tmp_path, valid_trace)[::23]
    replays = [Case(f"replay:{c.name}", ["replay", c.argv[1], "--backend", "reference"],
                    c.mentions) for c in cases[::2]]
    assert len(cases) >= 12
    for c in cases + replays:
        r = subprocess.run(KVSIM + c.argv, capture_output=True, text=True, timeout=60)
        assert problems(c, r.returncode, r.stdout + r.stderr) == [], (c.name, r.stderr)
