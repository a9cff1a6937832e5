"""Worker processes forked by one process that the caller forks (`gpu_backend.workers`).

Why: a fork holds the forking thread for about the time it takes to copy the page tables of
what the process has mapped, which is a lot once torch, CUDA and the trace are loaded. Forked
one by one from the replay's loop, four workers held the loop 76-102 ms before it could
prepare the prompts' step. Here the loop forks once; that child forks
the workers beside the loop, and they inherit the same memory.

Ending them: SIGTERM to the forking child (`stop`, or multiprocessing's own at exit) makes it
kill its workers and reap them, so none is left running or a zombie. A worker dies with the
child, and the child with the loop's thread (Linux's parent-death signal). ^C reaches the
workers as before (a KeyboardInterrupt, sent to the loop); the forking child ignores it and
waits to be stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any


def start(ctx: Any, target: Callable[..., None], jobs: Sequence[tuple[Any, ...]],
          ends: Sequence[Connection]) -> Any:
    """Fork one process that forks a worker per job, target(*jobs[w]); ends[w] is worker w's
    end of its pipe (the others' ends are closed in it, so the loop sees a dead worker's EOF).
    Returns the forking process (a `multiprocessing.Process`) for `stop`."""
    proc = ctx.Process(target=_fork_all, args=(os.getpid(), target, jobs, ends), daemon=True,
                       name="kvsim-prepare")
    proc.start()
    return proc


def stop(proc: Any, timeout: float = 5.0) -> None:
    """End the workers and the process that forked them, and wait for them."""
    proc.terminate()
    proc.join(timeout)
    if proc.is_alive():  # stuck: SIGKILL, and its workers get theirs from the kernel
        proc.kill()
        proc.join()


def _fork_all(loop: int, target: Callable[..., None], jobs: Sequence[tuple[Any, ...]],
              ends: Sequence[Connection]) -> None:
    pids: list[int] = []

    def end_all(*_: Any) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        os._exit(0)

    signal.signal(signal.SIGTERM, end_all)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != loop:  # the loop was gone before the line above
        os._exit(0)
    for w, job in enumerate(jobs):
        pid = os.fork()
        if pid == 0:
            _work(w, target, job, ends)
        pids.append(pid)
    for end in ends:
        end.close()
    for pid in pids:
        os.waitpid(pid, 0)


def _work(w: int, target: Callable[..., None], job: tuple[Any, ...],
          ends: Sequence[Connection]) -> None:
    """Worker w, in its own process: never returns."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _die_with_parent(signal.SIGKILL)
        for i, end in enumerate(ends):
            if i != w:
                end.close()
        target(*job)
        code = 0
    finally:
        os._exit(code)  # not the exit handlers this process inherited: they are the forker's


def _die_with_parent(sig: signal.Signals) -> None:
    """Have the kernel send `sig` to this process when the thread that forked it ends (Linux;
    elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
