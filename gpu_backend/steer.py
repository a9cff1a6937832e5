"""The replay loop's thread moved to the host's fastest CPU of the moment.

Why: a lent GPU host's virtual CPUs do not run at one speed. Each has slow spells of seconds,
one CPU at a time. In 45 s of sweeps of the H200 host's 16 (bench/results/round34/), the
slowest CPU took a median 1.91x the fastest's time for the same Python, and up to 3.99x. A
replay with many generation steps is bound by its loop thread's host work when that thread sits
on a slow CPU (docs/gpu.md, round 30), and Linux sees no difference between the CPUs, so it
does not move the thread. Pinned to the 4 CPUs fastest just before, a 64 x 2k, 96-step replay
took 54.2 ms against 57.4 on every CPU (round 34, call 1).

How: one watcher thread a CPU, parked there, times a fixed piece of compression (`_DATA`,
~0.1 ms) every `PERIOD` seconds by its own CPU time. zlib works without the GIL, and a thread
waiting for the GIL uses no CPU time, so the loop's Python neither slows a watch nor is slowed
by one. The loop looks at their figures after each step it queues (`Steer.tick`, at most every
`LOOK` seconds) and moves to the quickest CPU when its own is `SLOW` times slower: one move
(~100 µs in the lent VM), not one a CPU. The first version timed a probe on each CPU from the
loop's own thread, moving it to each in turn; a sweep cost 2.0-2.6 ms and gave nothing
reliable (round 34, 772954e). The watchers are started once a process, ended before a fork
(the preparation workers', `gpu_backend.forks`). Only the loop's thread moves, and the verdicts
do not depend on where it runs. Off where fewer than `MIN_CPUS` CPUs are allowed (CI's 2 cores;
the CPU backend, whose torch needs them) or where the OS has no CPU affinity.
"""

from __future__ import annotations

import os
import threading
import time
import zlib

ENABLED = True
PERIOD = 0.1  # s between a watcher's timings: the slow spells last seconds
LOOK = 0.02  # s between the loop's looks at the watchers' figures
SLOW = 1.3  # the loop's CPU this many times the quickest one's time: move
MIN_CPUS = 6  # allowed CPUs below which nothing moves
_DATA = bytes((i * 2654435761 >> 13) & 255 for i in range(1 << 12))  # compresses little


class Watchers:
    """A thread a CPU, each timing `_DATA`'s compression there every PERIOD seconds."""

    def __init__(self, cpus: list[int]):
        self.cpus = cpus
        self.took = dict.fromkeys(cpus, float("inf"))  # CPU seconds, the latest of each
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._watch, args=(c,), daemon=True,
                                         name=f"kvsim-watch-{c}") for c in cpus]
        for t in self.threads:
            t.start()

    def _watch(self, cpu: int) -> None:
        try:
            os.sched_setaffinity(0, (cpu,))
        except OSError:  # the CPU went away: nothing to watch
            return
        while True:
            t0 = time.thread_time()
            zlib.compress(_DATA, 1)
            self.took[cpu] = time.thread_time() - t0
            if self.stop.wait(PERIOD):
                return

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


_WATCHERS: tuple[int, Watchers] | None = None  # this process's (pid, watchers)


def watchers(cpus: list[int]) -> Watchers:
    """This process's watchers of `cpus`, started on first use."""
    global _WATCHERS
    if _WATCHERS is None or _WATCHERS[0] != os.getpid() or _WATCHERS[1].cpus != cpus:
        _stop()
        _WATCHERS = (os.getpid(), Watchers(cpus))
    return _WATCHERS[1]


def _stop() -> None:
    """Before a fork: the watchers end, so the process forks with no thread but the caller's
    (as `hostpool`'s). The next replay starts them again."""
    global _WATCHERS
    if _WATCHERS is not None and _WATCHERS[0] == os.getpid():
        _WATCHERS[1].close()
    _WATCHERS = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_stop)


class Steer:
    """The calling thread moved to the quickest watched CPU when its own is slow (`tick`), and
    given back every CPU it had (`close`)."""

    def __init__(self, enabled: bool = True):
        have = hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")
        self.own: set[int] = set(os.sched_getaffinity(0)) if have else set()
        on = enabled and ENABLED and len(self.own) >= MIN_CPUS
        self.watch = watchers(sorted(self.own)) if on else None
        self.here: int | None = None  # the CPU the thread is pinned to, once moved
        self.last = -float("inf")
        self.moves = self.looks = 0

    def tick(self) -> None:
        """A look at the watchers' figures, if one is due: a move to the quickest CPU when
        the thread's own is SLOW times slower (or not yet known: not pinned)."""
        if self.watch is None:
            return
        now = time.perf_counter()
        if now - self.last < LOOK:
            return
        self.last = now
        self.looks += 1
        took = dict(self.watch.took)
        best = min(took, key=took.__getitem__)
        if took[best] == float("inf"):
            return  # no figures yet
        if self.here is None or took[self.here] > SLOW * took[best]:
            os.sched_setaffinity(0, (best,))
            self.here = best
            self.moves += 1

    def close(self) -> None:
        if self.here is not None:
            os.sched_setaffinity(0, self.own)
            self.here = None
        self.watch = None

    def stats(self) -> dict[str, object]:
        return {"steer_moves": self.moves, "steer_looks": self.looks}
