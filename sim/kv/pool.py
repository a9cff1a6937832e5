"""KV block pool: refcounts, the free queue, the cache of block contents (mechanism only).

The cache is one of two structures, picked by the profile: TensorRT-LLM's reuse tree
(`sim/kv/radix.py`, matched by tokens) or a flat hash → block map (matched by hash).
A free block keeps its cached content until it is evicted to satisfy an allocation; in the
tree, evicting a block evicts its descendants with it. Allocation is check-then-commit:
`allocate(n)` returns None and changes nothing when n blocks are not free.
"""

from __future__ import annotations

import numpy as np

from sim.kv.events import EventLog
from sim.kv.free_queue import DEFAULT_PRIORITY, FreeQueue
from sim.kv.radix import RadixTree


class PoolIntegrityError(AssertionError):
    """The pool's own bookkeeping disagrees with itself; this is a bug in the KV pool."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, events: EventLog,
                 null_block: bool = False, tree: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self.null_block = null_block
        self.refcount = [0] * num_blocks
        first = 1 if null_block else 0  # vLLM keeps block 0 as a never-allocated null block
        self.free = FreeQueue(range(first, num_blocks), num_blocks)
        self.tree: RadixTree | None = RadixTree() if tree else None
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
            b = self.free.pop()  # the front: least recently freed
            if self.tree is not None:
                if b in self.tree:
                    self._drop_subtree(b, keep=-1)
            elif b in self.block_hash:  # uncache() below drops it from num_cached_free
                self.events.emit("evict", b, -1, 0, hash_=self.block_hash[b])
                self.uncache(b)
            self.refcount[b] = 1
            self.free.priority[b] = DEFAULT_PRIORITY  # getFreeBlock claims at the default
            self.events.emit("alloc", b, request, 1)
            out.append(b)
        return out

    def is_cached(self, b: int) -> bool:
        return b in self.tree if self.tree is not None else b in self.block_hash

    def touch(self, b: int, request: int) -> None:
        """Take a reference on a cached block (prefix hit); revives it from the free queue."""
        if self.refcount[b] == 0:
            self.free.remove(b)
            self.num_cached_free -= self.is_cached(b)
        self.refcount[b] += 1
        self.events.emit("reuse", b, request, self.refcount[b], hash_=self._hash(b))

    def take_in_place(self, b: int, request: int) -> None:
        """Claim cached block b to write past its matched tokens: it leaves the tree with its
        descendants (`freeLeafBlock`/`freeChildren`) but keeps its content, so no evict."""
        assert self.tree is not None, "in-place takes are a reuse-tree operation"
        h = self.tree.hash[b]
        if self.refcount[b] == 0:
            self.free.remove(b)
        self._drop_subtree(b, keep=b)
        self.refcount[b] += 1
        self.events.emit("reuse", b, request, self.refcount[b], hash_=h)

    def _drop_subtree(self, b: int, keep: int) -> None:
        """Unlink b and its descendants from the tree; free ones other than `keep` are evicted
        (a descendant a request still holds keeps its content, but nothing can match it)."""
        assert self.tree is not None
        for d, h in self.tree.remove_subtree(b):
            if self.refcount[d] == 0:
                self.num_cached_free -= 1
                if d != keep:
                    self.events.emit("evict", d, -1, 0, hash_=h)

    def _hash(self, b: int) -> int:
        if self.tree is not None:
            return self.tree.hash.get(b, 0)
        return self.block_hash.get(b, 0)

    def release(self, b: int, request: int, event: str = "free", front: bool = False) -> None:
        """Drop one reference; at zero the block joins the free queue's back (evicted last)
        or, with `front`, its front (evicted next)."""
        if self.refcount[b] <= 0:
            raise PoolIntegrityError(f"block {b} released with refcount {self.refcount[b]}; "
                                     "this is a bug in the KV manager")
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.free.push(b, front)
            self.num_cached_free += self.is_cached(b)
        self.events.emit(event, b, request, self.refcount[b])

    def store(self, node: int, b: int, tokens: np.ndarray) -> None:
        """Hang block b, holding `tokens` (a full block or a partial tail), under tree node
        `node` (`storeBlocks` inserting a block that matched nothing)."""
        assert self.tree is not None, "store is a reuse-tree operation"
        if b in self.tree:  # only after a fault let two requests write one block: it moves
            self._drop_subtree(b, keep=b)
        h = self.tree.insert(node, b, tokens)
        self.num_cached_free += self.refcount[b] == 0
        self.events.emit("hash", b, -1, self.refcount[b], num_tokens=len(tokens), hash_=h)

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
        cached = sum(1 for b in self.free if self.is_cached(b))
        if cached != self.num_cached_free:
            raise PoolIntegrityError(f"{cached} cached free blocks, counted {self.num_cached_free}")
