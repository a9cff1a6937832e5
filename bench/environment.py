"""What every benchmark result records next to its figures: when, where, with what; and the
argument type the bench scripts share (`positive`).

Imported by the bench scripts (run as `python bench/X.py`, so this directory is on sys.path).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvsim", "numpy", "numba", "pyarrow", "pydantic", "simpy", "hypothesis", "xxhash")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"  # e.g. a copy of the tree without .git (the GPU host)


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def environment() -> dict:
    """Date, commit (and whether the tree had uncommitted changes), machine, package versions."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": _git("rev-parse", "--short",
                                                                       "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
            "python": platform.python_version(), "machine": platform.machine(),
            "cpu": _cpu_model(), "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "versions": {p: _version(p) for p in PACKAGES}}


def host_speed() -> float:
    """ms this host takes for a fixed pure-Python and numpy workload (~4.5 ms on the H200's
    host in its usual state, ~7.5-8 in a slow spell). The lent hosts' virtual CPUs sometimes
    run everything ~1.8x slower for seconds, with nothing else of the process on the CPU;
    a bench times this just before each replay it times, so a slow run can be told from a slow
    change."""
    import numpy as np

    t0 = time.perf_counter()
    s = 0
    for i in range(100_000):
        s += i & 7
    a = np.arange(4096)
    for _ in range(300):
        a = np.concatenate([a[1:], a[:1]]) + 0
    return (time.perf_counter() - t0) * 1e3


def positive(text: str) -> int:
    """argparse type: a whole number of 1 or more, else a usage error saying so."""
    n = int(text) if text.strip().lstrip("-").isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return n
