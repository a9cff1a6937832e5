"""Interrupted runs: a killed `kvsim run` leaves the previous trace intact (or nothing), a
SIGTERM/SIGINT removes its temporary directory, a SIGKILL's leftover is refused by `kvsim check`
and cleaned by the next run to the same DIR; a killed sweep resumes from its cache."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.sweep.cache import ResultCache
from tests.hardening.corpus import BASE, to_toml

KVSIM = [sys.executable, "-c", "from sim.cli import main; main()"]


def _big(tmp: Path, requests: int = 600) -> Path:
    # big enough that a signal 0.2 s after the writer starts lands mid-run with room to spare
    # (150 requests left ~0.3 s once the traced run got faster)
    sc = json.loads(json.dumps(BASE))
    sc["workload"] = {"synthetic": {
        "num_requests": requests, "qps": 50.0,
        "prompt_len": {"kind": "uniform", "min": 16, "max": 200},
        "output_len": {"kind": "uniform", "min": 8, "max": 64}}}
    f = tmp / "big.toml"
    f.write_bytes(to_toml(sc))
    return f


def _kvsim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(KVSIM + list(args), capture_output=True, text=True, timeout=120)


def _start_and_kill(scenario: Path, out: Path, sig: int) -> tuple[subprocess.Popen[str], Path]:
    p = subprocess.Popen(KVSIM + ["run", str(scenario), "--out", str(out), "--force"], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tmp = out.with_name(f"{out.name}.tmp-{p.pid}")
    deadline = time.monotonic() + 60
    while not (tmp / "steps.parquet").exists():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # mid-write
    assert p.poll() is None, "the run finished before the signal: make the scenario bigger"
    p.send_signal(sig)
    p.communicate(timeout=60)
    return p, tmp


@pytest.fixture(scope="module")
def prior(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, bytes]:
    """A complete trace, written once; each test copies it as the previous run's output."""
    root = tmp_path_factory.mktemp("prior")
    sc = _big(root)
    r = _kvsim("run", str(sc), "--out", str(root / "trace"))
    assert r.returncode == 0, r.stderr
    return sc, root / "trace", (root / "trace" / "manifest.json").read_bytes()


def _copy_prior(prior: tuple[Path, Path, bytes], tmp: Path) -> Path:
    import shutil

    out = tmp / "trace"
    shutil.copytree(prior[1], out)
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_term_int_clean_up_and_keep_old_trace(tmp_path: Path, prior, sig: int) -> None:
    out = _copy_prior(prior, tmp_path)
    p, tmp = _start_and_kill(prior[0], out, sig)
    assert p.returncode == 130
    assert not tmp.exists()
    assert (out / "manifest.json").read_bytes() == prior[2]
    assert _kvsim("check", str(out)).returncode == 0


def test_sigkill_leftover_refused_then_cleaned(tmp_path: Path, prior) -> None:
    out = _copy_prior(prior, tmp_path)
    p, tmp = _start_and_kill(prior[0], out, signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL
    assert tmp.is_dir()  # nothing can clean up after SIGKILL...
    assert (out / "manifest.json").read_bytes() == prior[2]  # ...but the old trace is intact
    assert _kvsim("check", str(out)).returncode == 0
    r = _kvsim("check", str(tmp))
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert _kvsim("run", str(prior[0]), "--out", str(out), "--force").returncode == 0
    assert not tmp.exists()  # the next run to DIR removed the dead pid's leftover


def test_sigkill_without_prior_leaves_no_trace(tmp_path: Path, prior) -> None:
    out = tmp_path / "fresh"
    p, tmp = _start_and_kill(prior[0], out, signal.SIGKILL)
    assert not out.exists()
    assert _kvsim("check", str(out)).returncode == 2


def test_live_writers_temp_dir_is_kept(tmp_path: Path) -> None:
    from sim.trace.writer import remove_stale

    out = tmp_path / "trace"
    live = tmp_path / f"trace.tmp-{os.getppid()}"
    dead = tmp_path / "trace.tmp-999999999"
    live.mkdir()
    dead.mkdir()
    assert remove_stale(out) == [dead]
    assert live.is_dir()


def _sweep_file(tmp: Path) -> Path:
    sc = _big(tmp, requests=60)
    f = tmp / "sweep.toml"
    f.write_text(f'base = "{sc.name}"\n[grid]\n"cache.num_blocks" = [40, 48, 56, 64, 72, 80]\n')
    return f


def _entries(out: Path) -> int:
    return len(list((out / "cache").glob("*/*.json")))


def test_killed_sweep_resumes_from_cache(tmp_path: Path) -> None:
    sweep, out = _sweep_file(tmp_path), tmp_path / "sw"
    p = subprocess.Popen(KVSIM + ["sweep", str(sweep), "--out", str(out), "--workers", "1"],
                         text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while _entries(out) < 2:
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.kill()
    p.communicate(timeout=30)
    done = _entries(out)
    assert 2 <= done < 6
    assert not (out / "results.parquet").exists()
    for f in (out / "cache").glob("*/*.json"):
        assert ResultCache(out / "cache").get(f.stem) is not None  # no half entries
    r = _kvsim("sweep", str(sweep), "--out", str(out), "--workers", "1")
    assert r.returncode == 0, r.stderr
    m = re.search(r"6 points, (\d+) simulations run, (\d+) cached", r.stdout)
    assert m is not None, r.stdout
    assert (int(m[1]), int(m[2])) == (6 - done, done)
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def test_a_signal_whose_exception_was_swallowed_still_stops_the_run(tmp_path: Path,
                                                                      prior) -> None:
    """The CLI's handler notes the signal before raising: when the KeyboardInterrupt is dropped
    (a signal during pyarrow's lazy `import pandas` was: the run then replaced the previous
    trace and exited 0), the trace writer refuses to publish and the run unwinds as ^C."""
    from sim import interrupt
    from sim.api import load_scenario, run

    out = _copy_prior(prior, tmp_path)
    sc, base = load_scenario(prior[0])
    interrupt.note()  # what the handler does; its exception never arrives
    try:
        with pytest.raises(KeyboardInterrupt):
            run(sc, out=out, base_dir=base)
    finally:
        interrupt.clear()
    assert (out / "manifest.json").read_bytes() == prior[2]
    assert not list(tmp_path.glob("trace.tmp-*"))


@pytest.mark.parametrize("error", [SystemError, AttributeError])
def test_an_error_a_signal_caused_exits_as_interrupted(error: type[Exception]) -> None:
    """A SIGTERM landing in pandas' Cython module init (pyarrow imports it lazily) surfaced as
    SystemError or AttributeError and the run exited 1 with a traceback (CI, stop 12): once a
    signal was noted, the CLI reports any error that unwinds the run as the interrupt."""
    import typer

    from sim import interrupt
    from sim.cli.common import user_errors

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(error):  # without a signal, a bug still shows as itself
            with user_errors():
                raise error("partially initialized module 'pandas'")
        interrupt.note()
        with pytest.raises(typer.Exit) as e:
            with user_errors():
                raise error("partially initialized module 'pandas'")
        assert e.value.exit_code == 130
    finally:
        interrupt.clear()
        for s, h in saved.items():
            signal.signal(s, h)
