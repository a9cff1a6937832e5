"""gpu_backend/forks.py: workers forked by one forked process run their jobs, each with only
its own pipe end open; `stop`, a SIGTERM to the forker (multiprocessing's at exit) and the
death of the process that started them all end the workers, none left running or a zombie."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpu_backend import forks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, /proc")


def _echo(w: int, conn: mp.connection.Connection) -> None:
    conn.send((w, os.getpid()))
    conn.close()


def _sleep(w: int, conn: mp.connection.Connection) -> None:
    conn.send((w, os.getpid()))
    time.sleep(60)


def _start(target: object, n: int) -> tuple[mp.Process, list[mp.connection.Connection]]:
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(n)]
    proc = forks.start(ctx, target, [(w, send) for w, (_, send) in enumerate(pipes)],
                       [send for _, send in pipes])
    for _, send in pipes:
        send.close()
    return proc, [recv for recv, _ in pipes]


def _gone(pids: list[int], zombies: bool = False, wait: float = 5.0) -> bool:
    """No process of pids is left (zombies: or only zombies, which whoever adopted an orphan
    reaps; not every container's first process does)."""
    end = time.monotonic() + wait
    while time.monotonic() < end:
        if not [p for p in pids if _state(p) not in ("", "Z" if zombies else "")]:
            return True
        time.sleep(0.02)
    return False


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_each_worker_runs_its_job_and_its_pipe_ends_with_it() -> None:
    proc, recvs = _start(_echo, 3)
    got = [r.recv() for r in recvs]
    assert [w for w, _ in got] == [0, 1, 2]
    assert len({pid for _, pid in got} | {proc.pid, os.getpid()}) == 5
    for r in recvs:  # every write end is closed once its worker is done: EOF, not a hang
        assert r.poll(5)
        with pytest.raises(EOFError):
            r.recv()
    proc.join(5)
    assert proc.exitcode == 0
    assert _gone([pid for _, pid in got])


@pytest.mark.parametrize("how", ["stop", "sigterm"])
def test_stopping_the_forker_ends_its_workers(how: str) -> None:
    proc, recvs = _start(_sleep, 2)
    pids = [r.recv()[1] for r in recvs]
    if how == "stop":
        forks.stop(proc)
    else:  # as multiprocessing's exit handler does to a daemon process
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(5)
    assert not proc.is_alive()
    assert _gone(pids)


def test_the_workers_die_with_the_process_that_started_them(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(
        "import multiprocessing as mp, os, sys\n"
        f"sys.path[:0] = [{str(Path(__file__).parent)!r}, {os.getcwd()!r}]\n"
        "from test_forks import _start, _sleep\n"
        "proc, recvs = _start(_sleep, 2)\n"
        "print(proc.pid, *[r.recv()[1] for r in recvs], flush=True)\n"
        "os._exit(0)\n")  # no clean-up: as if killed
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=30, check=True)
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == 3
    assert _gone(pids[1:])  # the workers: their forker reaped them
    assert _gone(pids[:1], zombies=True)
