"""Output buffers handed to the trace writer without a copy, taken back once it lets go."""

from __future__ import annotations

import sys

import numpy as np


def _unreferenced() -> int:
    """sys.getrefcount of an array that one list slot alone references, asked as `swap` asks
    it (2 on CPython 3.11-3.13: the slot and the argument; interpreters may count differently)."""
    pool = [np.empty(0)]
    return sys.getrefcount(pool[0])


_UNREFERENCED = _unreferenced()
POISON = False  # Recycler's default (tests set it)


class Recycler:
    """Buffers for the compiled loop to fill, reused instead of allocated at every drain.

    `swap(old)` takes the buffer the last drain handed over (the trace writer keeps views of it
    until their row group is written) and returns one that nothing references any more: a buffer
    handed over earlier whose views have all died, or a new one. Reference counts say exactly
    when that is: each Arrow array the writer holds keeps the numpy view it was built over
    alive, and each view its buffer (numpy views point at the array owning the memory). The
    buffers must own their memory (`base is None`). CPython with the GIL: the counts are exact.

    Fresh memory costs a page fault per 4 KiB on the loop's first write (~40 MB a drain when
    traced), and copying the columns instead costs the main thread ~0.17 s per 10k requests.

    poison: fill every buffer handed out with a pattern (tests: a column read from memory the
    loop did not write this drain changes the trace's digest).
    """

    def __init__(self, keep: int = 8, poison: bool | None = None) -> None:
        self.pool: list[np.ndarray] = []
        self.keep, self.poison = keep, POISON if poison is None else poison
        self.reused = 0  # buffers handed out again (not allocated)

    def swap(self, old: np.ndarray) -> np.ndarray:
        if old.base is not None:
            raise ValueError("a recycled buffer must own its memory")
        pool = self.pool
        i = next((i for i in range(len(pool))
                  if pool[i] is not old and sys.getrefcount(pool[i]) == _UNREFERENCED), -1)
        new = pool.pop(i) if i >= 0 else np.empty_like(old)
        self.reused += i >= 0
        if not any(b is old for b in pool):
            pool.append(old)
        del pool[:-self.keep]  # a buffer dropped here is freed once the writer lets go of it
        if self.poison:
            new.fill(-7)
        return new
