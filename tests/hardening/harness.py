"""Run many CLI cases in one process (typer's CliRunner) and check the bad-input contract."""

from __future__ import annotations

import os
from pathlib import Path

from typer.testing import CliRunner

from sim.cli import app
from tests.hardening.corpus import Case

RUNNER = CliRunner()


def invoke(argv: list[str]) -> tuple[int, str]:
    r = RUNNER.invoke(app, argv, catch_exceptions=True)
    out = r.output
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback
        out += "Traceback (uncaught)\n" + "".join(traceback.format_exception(r.exception))
    return r.exit_code, out


def stray_tmp(folder: Path) -> list[str]:
    return [n for n in os.listdir(folder) if ".tmp-" in n]


def problems(case: Case, code: int, out: str) -> list[str]:
    """What is wrong with one case's outcome (empty: it honours the contract)."""
    bad = []
    if code != 2:
        bad.append(f"exit {code}")
    if "Traceback" in out:
        bad.append("traceback")
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    if len(lines) != 1 or not lines[0].startswith("error:"):
        bad.append(f"{len(lines)} lines")
    for m in case.mentions:
        if m not in out:
            bad.append(f"does not name {m!r}")
    if case.out is not None and case.out.exists():
        bad.append(f"{case.out} was written")
    if case.out is not None and stray_tmp(case.out.parent):
        bad.append(f"stray temp {stray_tmp(case.out.parent)}")
    return bad
