"""The host's threads for a long step's compiled passes (`flatten.split`,
`prepk.content_split`): the prompts' step, whose preparation the device waits for before its
first launch. The passes release the GIL, so the parts run at once on the host's cores."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

THREADS = 8  # at most (fewer where the host has fewer cores)
# a step of at least this many appends is split: the prompts' step; a generation step's few
# hundred are one call each
SPLIT = 1 << 15
_POOL: tuple[int, ThreadPoolExecutor] | None = None


_CPUS = os.cpu_count() or 1  # asked once: each call reads the kernel's CPU list (twice a step)


def threads() -> int:
    """Threads a long step's passes are split across on this host (1: not split)."""
    return min(THREADS, _CPUS)


def parts(n: int) -> int:
    """Parts a pass over n appends (or queries) is split into: 1, one call, below SPLIT."""
    return threads() if n >= SPLIT else 1


def pool() -> ThreadPoolExecutor:
    """This process's threads, started on first use (a forked process starts its own)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(threads(), thread_name_prefix="kvsim-host"))
    return _POOL[1]


