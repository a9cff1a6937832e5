"""An interrupted fuzz campaign: SIGKILL mid-search leaves no finding that looks whole, and a
rerun with the same example database resumes from what the killed one had saved."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "trtllm-post-17264+append_into_shared"


def _fuzz(out: Path, db: Path, budget: int) -> list[str]:
    return [sys.executable, "-c", "from sim.cli import main; main()", "fuzz", "--profile",
            PROFILE, "--budget", str(budget), "--out", str(out), "--db", str(db),
            "--baseline", "trtllm-post-17264", "--ignore", "hang", "--json"]


def _saved_failures(db: Path) -> int:
    """Failing examples hypothesis saved under the campaign's key (not its other entries)."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    from sim.fuzz.campaign import database_key
    return len(list(DirectoryBasedExampleDatabase(str(db)).fetch(database_key(PROFILE))))


def test_killed_campaign_resumes_from_its_database(tmp_path: Path) -> None:
    out, db = tmp_path / "finding", tmp_path / "db"
    proc = subprocess.Popen(_fuzz(out, db, 120), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.monotonic()
    try:  # hypothesis saves failing examples while it shrinks: wait for the first one
        while not _saved_failures(db) and time.monotonic() - t0 < 90:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the campaign ended before it could be killed"
    assert _saved_failures(db), "no failing example saved before the kill"
    assert not (out / "finding.json").exists(), "a killed campaign left a finding that looks whole"
    res = subprocess.run(_fuzz(out, db, 60), cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 1, res.stderr
    found = json.loads(res.stdout)["finding"]
    # the saved failing example is replayed first: found at once, not searched for again
    assert found["invariant"] == "I5" and found["found_at_example"] <= 2, found
    assert (out / "scenario.toml").is_file()
