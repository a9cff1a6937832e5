"""The replay loop's thread kept on the host's fastest CPUs of the moment.

Why: a lent GPU host's virtual CPUs do not run at one speed. Each has slow spells of seconds,
and they come at different times on different CPUs. In a 45 s sweep of the H200 host's 16
(bench/results/round34/), the slowest CPU took a median 1.91x the fastest's time for the same
Python, and up to 3.99x. In every sweep some CPUs ran it at the host's best speed. A replay
with many generation steps is bound by its loop thread's host work when that thread sits on a
slow CPU (docs/gpu.md, round 30). Linux sees no difference between the CPUs, so it does not
move the thread.

How: `Steer.tick` times a short fixed piece of Python (`_probe`, ~35 µs at the H200 host's best)
on the thread's CPU, once `PERIOD` seconds have passed since it last did. If that took over
`SLOW` times the quickest probe this process has seen, or none has been seen, it sweeps: the
probe on each allowed CPU in turn, the thread pinned there, then the thread kept to the
`FASTEST` quickest. A sweep costs ~2-2.6 ms on the H200's host (most of it moving the thread
to each CPU), so it is done only when the thread is slow where it is: on a fast host, a sweep
at every replay's start cost a 96-step replay more than it gained (round 34). The loop ticks
after each step it queues, not before the first: a sweep there (the thread on a slow CPU)
came before any device work, and a 12-step replay's wall grew by it (round 34). `close`
gives the thread back every CPU it had. Only the loop's thread moves; the verdicts do not
depend on where it runs. Off where fewer than `MIN_CPUS` CPUs are allowed (CI's 2 cores, the
CPU backend, whose torch needs them) or where the OS has no CPU affinity.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

ENABLED = True
FASTEST = 4  # CPUs the loop's thread is kept to
PERIOD = 0.02  # s between looks at the thread's own CPU (a look: ~35 µs)
SLOW = 1.3  # a probe this many times the quickest seen: the thread's CPU is slow, sweep
MIN_CPUS = 6  # allowed CPUs below which nothing moves
PROBE = 1000  # iterations of `_probe`'s loop: ~35 µs at the H200 host's best speed
_QUICKEST = [float("inf")]  # the quickest probe this process has seen (s), on any CPU


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
        """A look at the thread's CPU, if one is due; a sweep if it is slow (the thread then
        runs on the fastest CPUs found)."""
        if not self.cpus:
            return
        t0 = time.perf_counter()
        if t0 - self.last < PERIOD:
            return
        self.last = t0
        self.looks += 1
        quickest = _QUICKEST[0]
        here = _timed()
        if here > SLOW * quickest:  # once more: an interrupt may have made it slow
            here = min(here, _timed())
        if here <= SLOW * quickest < float("inf"):  # fast enough where it is
            _QUICKEST[0] = min(quickest, here)
            self.seconds += time.perf_counter() - t0
            return
        took = speeds(self.cpus)
        _QUICKEST[0] = min(_QUICKEST[0], *took.values())
        self.kept = sorted(self.cpus, key=took.__getitem__)[: max(FASTEST, 1)]
        os.sched_setaffinity(0, self.kept)
        self.last = time.perf_counter()
        self.seconds += self.last - t0
        self.sweeps += 1

    def close(self) -> None:
        """Every CPU the thread had back; no sweep after this."""
        if self.sweeps:
            os.sched_setaffinity(0, self.own)
        self.cpus = []

    def stats(self) -> dict[str, object]:
        return {"steer_sweeps": self.sweeps, "steer_looks": self.looks, "steer_s": self.seconds,
                "steer_cpus": self.kept}


def speeds(cpus: Iterable[int]) -> dict[int, float]:
    """Seconds `_probe` took on each CPU, this thread pinned to each in turn (it stays on the
    last: the caller pins it)."""
    out = {}
    for c in cpus:
        os.sched_setaffinity(0, (c,))  # returns once the thread runs there
        out[c] = _timed()
    return out


def _timed() -> float:
    t0 = time.perf_counter()
    _probe(PROBE)
    return time.perf_counter() - t0


def _probe(n: int) -> int:
    """Plain interpreted Python, the kind of work that slows in a slow spell (the same kind
    as `bench/environment.host_speed`)."""
    s = 0
    for i in range(n):
        s += i & 7
    return s
