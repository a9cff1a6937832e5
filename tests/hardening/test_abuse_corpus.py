"""The abuse corpus (abuse_corpus.py) against the bad-input contract: exit 2, one line naming
the file or flag and the field, no traceback, nothing written.

Cases that would hang or allocate without their limit run each in its own process, forked from
this one (milliseconds each, not an interpreter start), under LIMIT_S of wall-clock and
LIMIT_RSS_KB of peak RSS, with the address space capped so that a regression fails the case
instead of the machine. The rest run in-process; a sample of both runs through fresh
interpreters, as a terminal would see them.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

from sim.config import parse_scenario
from sim.cost.calibration import load_calibration
from sim.sweep.spec import load_sweep
from tests.hardening.abuse_corpus import (
    CAL_OK,
    AbuseCase,
    all_cases,
    materialise,
    scenario_bases,
    sweep_cases,
)
from tests.hardening.harness import invoke, problems

LIMIT_S = 10.0
LIMIT_RSS_KB = 1536 * 1024  # ru_maxrss is in KiB on Linux
_HEADROOM_AS = 3 << 30  # address space a forked case may add to what it inherits


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[AbuseCase]:
    out = all_cases(tmp_path_factory.mktemp("abuse"))
    for c in out:
        materialise(c)
    return out


def test_corpus_is_large_and_distinct(cases: list[AbuseCase]) -> None:
    assert len(cases) >= 320
    assert len({c.name for c in cases}) == len(cases)
    assert sum(c.resource for c in cases) >= 40


def test_bases_are_valid(tmp_path: Path) -> None:
    """Each case breaks one thing of a valid input: the bases themselves pass."""
    import json

    for base, _ in scenario_bases(tmp_path).values():
        parse_scenario(base)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL_OK))
    assert load_calibration(str(cal), (32, 8, 128)).attn
    ok = next(c for c in sweep_cases(tmp_path) if c.name == "sweep-search-hi-1e300")
    materialise(ok)
    sweep = Path(ok.argv[1])
    sweep.write_text(sweep.read_text().replace("1e+300", "64.0"))
    assert load_sweep(sweep)[0].search is not None


def test_in_process(cases: list[AbuseCase]) -> None:
    failures = []
    for c in cases:
        if not c.resource:
            code, out = invoke(c.argv)
            bad = problems(c, code, out)
            if bad:
                failures.append(f"{c.name}: {', '.join(bad)}\n    {out.strip()[:300]}")
    assert failures == []


def _child(argv: list[str], log: int) -> None:
    """In the forked child: the CLI with its output to `log`; never returns."""
    code = 99
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the process ends below)
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        size = _vm_size()
        resource.setrlimit(resource.RLIMIT_AS, (size + _HEADROOM_AS, size + _HEADROOM_AS))
        sys.argv = ["kvsim", *argv]
        from sim.cli import main

        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 16 << 30


def forked(argv: list[str]) -> tuple[int, str, float, int]:
    """(exit code, output, wall seconds, peak RSS KiB) of the CLI in a forked process."""
    with tempfile.TemporaryFile() as log:
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(argv, log.fileno())
        killed = False
        while True:
            done, status, ru = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - t0 > LIMIT_S:
                os.kill(pid, signal.SIGKILL)
                _, status, ru = os.wait4(pid, 0)
                killed = True
                break
            time.sleep(0.002)
        wall = time.monotonic() - t0
        log.seek(0)
        out = log.read().decode(errors="replace")
    code = -1 if killed else os.waitstatus_to_exitcode(status)
    return code, out, wall, ru.ru_maxrss


def test_resource_cases_in_processes(cases: list[AbuseCase]) -> None:
    """Every resource case (and a sample of the rest) in its own process, within the limits."""
    chosen = [c for c in cases if c.resource] + [c for c in cases if not c.resource][::25]
    failures = []
    for c in chosen:
        code, out, wall, rss = forked(c.argv)
        bad = problems(c, code, out)
        if wall > LIMIT_S:
            bad.append(f"took {wall:.1f} s")
        if rss > LIMIT_RSS_KB:
            bad.append(f"peak RSS {rss // 1024} MiB")
        if bad:
            failures.append(f"{c.name}: {', '.join(bad)}\n    {out.strip()[-600:]}")
    assert failures == [], "\n".join(failures)


def test_fresh_interpreter_sample(cases: list[AbuseCase]) -> None:
    """A few cases of each kind through `python -c`: what a terminal shows, imports included."""
    kvsim = [sys.executable, "-c", "from sim.cli import main; main()"]
    kinds = ("explicit", "synthetic", "roofline", "trace", "calibration", "sweep", "input",
             "flag")
    picked = [min((c for c in cases if c.name.startswith(k + "-")),
                  key=lambda c: not c.resource) for k in kinds]
    for c in picked:
        t0 = time.monotonic()
        r = subprocess.run(kvsim + c.argv, capture_output=True, text=True, timeout=60)
        assert problems(c, r.returncode, r.stdout + r.stderr) == [], (c.name, r.stderr)
        assert time.monotonic() - t0 < 60
