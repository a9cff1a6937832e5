"""The replay loop's thread kept on the host's quickest CPUs of the moment.

Why: a lent GPU host's virtual CPUs do not run at one speed. Each has slow spells of seconds,
one CPU at a time: in 45 s of sweeps of the H200 host's 16, the slowest CPU took a median 1.91x
the quickest's time for the same Python (round 34). A 64 x 2k replay's generation steps wait on
the loop thread's host work while that thread sits on a slow CPU (round 30), and Linux sees no
difference between the CPUs, so it does not move the thread. Pinned to the 4 CPUs quickest just
before, a 96-step replay took 54.2 ms against 57.4 on every CPU (round 34, call 1).

How: one parked thread a CPU (`Probes`), pinned there once. A sweep wakes them all; each times
a fixed piece of Python (`_probe`, ~17 µs at the H200 host's best) on its CPU while it holds
the GIL, so they take turns and no two probes run at once (sibling hyperthreads would slow
each other). The loop's thread waits, then keeps to the `FASTEST` quickest CPUs: it moves once,
not once a CPU. Round 34's sweeps moved the loop's thread to each CPU in turn (~100 µs a move
in this VM, 2.0-2.6 ms a sweep) and gave nothing reliable; its watcher threads timed zlib, not
Python. Here `Steer.tick` times the probe where the loop runs (~35 µs) at the replay's start
and then every `PERIOD` seconds, and sweeps only when that took `SLOW` times the quickest probe
this process has seen (or none has been seen). Only the loop's thread moves, and the verdicts
do not depend on where it runs. Off where fewer than `MIN_CPUS` CPUs are allowed (CI's 2
cores; the CPU backend, whose torch needs them), where the OS has no CPU affinity, or with
KVSIM_STEER=0. `close` gives the thread back every CPU it had.
"""

from __future__ import annotations

import os
import threading
import time

ENABLED = os.environ.get("KVSIM_STEER", "1") != "0"
FASTEST = 4  # CPUs the loop's thread is kept to
PERIOD = 0.05  # s between looks at the loop thread's own CPU (a look: two probes)
SLOW = 1.3  # a look this many times the quickest probe seen: the loop's CPU is slow, sweep
MIN_CPUS = 6  # allowed CPUs below which nothing moves
PROBE = 500  # iterations of `_probe`'s loop
WAIT = 0.05  # s a sweep waits for its probes at most (a CPU taken away: left out)
_QUICKEST = [float("inf")]  # the quickest probe this process has seen (s), on any CPU


class Probes:
    """A daemon thread parked on each CPU of `cpus`, timing `_probe` there when swept."""

    def __init__(self, cpus: list[int]):
        self.cpus = cpus
        self.cv = threading.Condition()
        self.round = 0
        self.took: dict[int, float] = {}
        self.done = threading.Event()
        for c in cpus:
            threading.Thread(target=self._park, args=(c,), daemon=True,
                             name=f"kvsim-probe-{c}").start()

    def sweep(self) -> dict[int, float]:
        """Seconds the probe took on each CPU (the least of two), those that answered in
        WAIT seconds."""
        with self.cv:
            self.round += 1
            self.took = {}
            self.done.clear()
            self.cv.notify_all()
        self.done.wait(WAIT)
        with self.cv:
            return dict(self.took)

    def _park(self, cpu: int) -> None:
        try:
            os.sched_setaffinity(0, (cpu,))
        except OSError:  # the CPU went away: this one never answers
            return
        seen = 0
        while True:
            with self.cv:
                while self.round == seen:
                    self.cv.wait()
                seen = self.round
            took = min(_timed(), _timed())  # the GIL held throughout: one probe at a time
            with self.cv:
                if self.round == seen:
                    self.took[cpu] = took
                    if len(self.took) == len(self.cpus):
                        self.done.set()


_PROBES: list[Probes] = []  # one set a process, started by the first steered replay


def probes(cpus: list[int]) -> Probes:
    if not _PROBES or _PROBES[0].cpus != cpus:
        _PROBES[:] = [Probes(cpus)]
    return _PROBES[0]


class Steer:
    """The calling thread's CPUs, chosen by speed (`tick`) and given back (`close`)."""

    def __init__(self, enabled: bool = True):
        have = hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")
        self.own: set[int] = set(os.sched_getaffinity(0)) if have else set()
        self.cpus = sorted(self.own) if enabled and ENABLED and len(self.own) >= MIN_CPUS \
            else []
        self.last = -float("inf")
        self.sweeps = self.looks = 0
        self.seconds = 0.0
        self.kept: list[int] = []

    def tick(self) -> None:
        """A look at the thread's CPU if one is due (the first always is); a sweep if it is
        slow, the thread then kept to the quickest CPUs found."""
        if not self.cpus:
            return
        t0 = time.perf_counter()
        if t0 - self.last < PERIOD:
            return
        self.looks += 1
        here = min(_timed(), _timed())
        quickest = _QUICKEST[0]
        if here <= SLOW * quickest:  # fast enough where it is (inf: nothing seen yet)
            _QUICKEST[0] = min(quickest, here)
        else:
            self._sweep()
        self.last = time.perf_counter()
        self.seconds += self.last - t0

    def _sweep(self) -> None:
        took = probes(self.cpus).sweep()
        if not took:
            return
        _QUICKEST[0] = min(_QUICKEST[0], *took.values())
        self.kept = sorted(took, key=took.__getitem__)[: max(FASTEST, 1)]
        os.sched_setaffinity(0, self.kept)
        self.sweeps += 1

    def close(self) -> None:
        """Every CPU the thread had back; no look after this."""
        if self.sweeps:
            os.sched_setaffinity(0, self.own)
        self.cpus = []

    def stats(self) -> dict[str, object]:
        return {"steer_sweeps": self.sweeps, "steer_looks": self.looks, "steer_s": self.seconds,
                "steer_cpus": self.kept}


def _timed() -> float:
    t0 = time.perf_counter()
    _probe(PROBE)
    return time.perf_counter() - t0


def _probe(n: int) -> int:
    """Plain interpreted Python, the kind of work that slows in a slow spell (as
    `bench/environment.host_speed`)."""
    s = 0
    for i in range(n):
        s += i & 7
    return s
