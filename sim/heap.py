"""Keep freed memory in the process's heap while a hot loop runs (glibc's `mallopt`).

Why: glibc serves an allocation above its mmap threshold (128 KiB at start, raised to the size
of each such block freed, up to 32 MiB) with a fresh `mmap`, and it gives the heap's free top
back to the kernel once that exceeds twice the threshold. A step that makes and drops many
arrays of a few hundred KiB therefore gets new memory, much of it every step, and each 4 KiB
page of it faults on first write. On this project's 2-core development machines (VMs) a fault
costs ~3.5 µs: a numba pass that writes ten 131k-element arrays took 8.7 ms, 0.5 ms once the heap
kept its memory. The GPU replay's preparation of a prompts' step took 0.80x the time at 64 x 2k
and 0.92x at 128 x 8k (alternated in forked processes here; the generation steps' arrays are
small, and theirs did not change).

While `kept()` is active, allocations up to 32 MiB (glibc's most) come from the heap, which
gives nothing back; on exit it is trimmed (`malloc_trim`), unless `kept(trim=False)`: then the
process keeps the freed memory for its next use, and `trim()` gives it back when the caller
chooses. The GPU replay takes that: on the H200's host the trim took 0.9-1.6 ms of every
replay's wall, after the device had finished. Peak memory is unchanged
either way: only freed memory is held, and reused. (A 64 MiB top pad as well made no
difference.)

Any `mallopt` of these stops glibc adapting its mmap threshold for good (mallopt(3)), so on exit
the settings are not glibc's initial ones, which a process that ever freed a large array has
left long behind (a fixed 128 KiB threshold faulted ten times as often as a fresh interpreter
in tests/unit/test_heap.py): they are where that adaptation ends, a 32 MiB threshold and twice
that of free heap kept. Elsewhere than glibc (musl, macOS) there is no `mallopt` and this does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30}
# on exit: where glibc's own adaptation ends once a 32 MiB block has been freed (mmap
# threshold = the block, trim threshold = twice it)
AFTER = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 64 << 20}


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def available() -> bool:
    return _LIBC is not None


_depth = 0  # kept() blocks open: the outermost sets and resets


@contextmanager
def kept(trim: bool = True) -> Iterator[None]:
    """Freed memory stays in the heap inside the block (see the module's docstring); trim: give
    the heap's free memory back to the kernel at its end (the outermost block's say)."""
    global _depth
    if _LIBC is None:
        yield
        return
    if _depth == 0:
        for k, v in KEPT.items():
            _LIBC.mallopt(k, v)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            for k, v in AFTER.items():
                _LIBC.mallopt(k, v)
            if trim:
                _LIBC.malloc_trim(0)


def trim() -> None:
    """Give the heap's free memory back to the kernel now (after a `kept(trim=False)`)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
