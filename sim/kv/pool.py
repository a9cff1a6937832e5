"""KV block pool: refcounts, LRU free queue, hash → cached block (mechanism only).

A free block keeps its cached content (and hash) until it is evicted to satisfy an allocation.
Allocation is check-then-commit: `allocate(n)` returns None and changes nothing when n blocks
are not free.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from sim.kv.events import EventLog


class PoolIntegrityError(AssertionError):
    """The pool's own bookkeeping disagrees with itself; this is a bug in the KV pool."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, events: EventLog,
                 null_block: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self.null_block = null_block
        self.refcount = [0] * num_blocks
        first = 1 if null_block else 0  # vLLM keeps block 0 as a never-allocated null block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(first, num_blocks))
        self.block_hash: dict[int, int] = {}
        self.block_parent: dict[int, int] = {}
        self.block_tokens: dict[int, np.ndarray] = {}
        self.cached: dict[int, int] = {}  # hash -> block
        self.children: dict[int, list[int]] = {}  # parent hash -> cached blocks
        self.num_cached_free = 0  # free blocks still holding hashed content (kept in step)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - (1 if self.null_block else 0)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self.free)

    def allocate(self, n: int, request: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _v = self.free.popitem(last=False)  # LRU head: least recently freed
            if b in self.block_hash:  # uncache() below drops it from num_cached_free
                self.events.emit("evict", b, -1, 0, hash_=self.block_hash[b])
                self.uncache(b)
            self.refcount[b] = 1
            self.events.emit("alloc", b, request, 1)
            out.append(b)
        return out

    def touch(self, b: int, request: int) -> None:
        """Take a reference on a cached block (prefix hit); revives it from the free queue."""
        if self.refcount[b] == 0:
            del self.free[b]
            self.num_cached_free -= b in self.block_hash
        self.refcount[b] += 1
        self.events.emit("reuse", b, request, self.refcount[b], hash_=self.block_hash.get(b, 0))

    def release(self, b: int, request: int, event: str = "free") -> None:
        if self.refcount[b] <= 0:
            raise PoolIntegrityError(f"block {b} released with refcount {self.refcount[b]}; "
                                     "this is a bug in the KV manager")
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.free[b] = None  # tail: evicted last
            self.num_cached_free += b in self.block_hash
        self.events.emit(event, b, request, self.refcount[b])

    def register(self, b: int, h: int, parent: int, tokens: np.ndarray) -> None:
        """Record that full block b holds the content keyed by hash h (first writer wins)."""
        if h in self.cached or b in self.block_hash:
            return
        self.cached[h] = b
        self.block_hash[b] = h
        self.block_parent[b] = parent
        self.block_tokens[b] = tokens
        self.children.setdefault(parent, []).append(b)
        self.events.emit("hash", b, -1, self.refcount[b], num_tokens=len(tokens), hash_=h)

    def uncache(self, b: int) -> None:
        if self.refcount[b] == 0:
            self.num_cached_free -= 1
        h = self.block_hash.pop(b)
        del self.cached[h]
        parent = self.block_parent.pop(b)
        self.children[parent].remove(b)
        if not self.children[parent]:
            del self.children[parent]
        del self.block_tokens[b]

    def check_integrity(self) -> None:
        free_ok = all(self.refcount[b] == 0 for b in self.free)
        used = sum(1 for b in range(self.num_blocks) if self.refcount[b] > 0)
        if not free_ok or used + len(self.free) != self.num_usable:
            raise PoolIntegrityError(f"free {len(self.free)} + used {used} != {self.num_usable}")
        cached = sum(1 for b in self.free if b in self.block_hash)
        if cached != self.num_cached_free:
            raise PoolIntegrityError(f"{cached} cached free blocks, counted {self.num_cached_free}")
