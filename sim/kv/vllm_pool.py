"""vLLM's block pool, as vLLM 0.33.0 keeps it (vllm/v1/core/block_pool.py, `BlockPool`; the free
queue is kv_cache_utils.py `FreeKVCacheBlockQueue`).

What differs from kvsim's TensorRT-LLM pool (sim/kv/pool.py), each as vLLM does it:
- block 0 is the null block, never handed out;
- `free_blocks` takes the blocks in eviction order (a request's tail first); those without a
  hash go to the front of the free queue (reused first), hashed ones to the back (LRU);
- the cache is not de-duplicated: two blocks may hold one hash (`BlockHashToBlockMap`), and a
  lookup returns the first of them still cached.

Block events go to `events` as the vLLM driver records them (sim/engines/vllm_driver.py,
`Recorder`): `[event, block, request, refcount, num_tokens, hash]`, tagged with `request`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def chain_hash(parent: int, tokens: list[int]) -> int:
    """A block's hash: its parent's and its tokens' (64-bit; never Python's hash())."""
    d = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    d.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(d.digest(), "little")


class VllmPool:
    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.B = block_size
        self.caching = caching
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        # block 0 is vLLM's null block: popped from the queue at start, never freed
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[int, dict[int, None]] = {}  # hash -> its blocks, first cached first
        self.num_cached_free = 0
        self.events: list[list] = []
        self.req = -1  # the request the current manager call serves (tags the events)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _ev(self, kind: str, b: int, ref: int, h: int = 0) -> None:
        self.events.append([kind, b, self.req, ref, self.B if kind == "hash" else 0, h])

    def first_cached(self, h: int) -> int | None:
        blocks = self.cached.get(h)
        return next(iter(blocks)) if blocks else None

    def get_new_blocks(self, n: int) -> list[int]:
        """`BlockPool.get_new_blocks`: the queue's head; a cached one is evicted first."""
        if n > len(self.free):
            raise AssertionError(f"{n} blocks asked, {len(self.free)} free; this is a bug in "
                                 "the vLLM KV manager (allocate_slots checks first)")
        out = [self.free.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            if self.hash[b] is not None:
                self.num_cached_free -= 1
                if self.caching:
                    self._evict(b)
            self.ref[b] = 1
        for b in out:
            self._ev("alloc", b, 1)
        return out

    def _evict(self, b: int) -> None:
        h = self.hash[b]
        assert h is not None
        self._ev("evict", b, self.ref[b])
        blocks = self.cached[h]
        del blocks[b]
        if not blocks:
            del self.cached[h]
        self.hash[b] = None

    def touch(self, blocks: list[int]) -> None:
        """A prefix hit takes a reference; a free block leaves the queue."""
        for b in blocks:
            self._ev("reuse", b, self.ref[b] + 1)
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
                self.num_cached_free -= self.hash[b] is not None
            self.ref[b] += 1

    def free_blocks(self, ordered: list[int]) -> None:
        """Blocks in eviction order: hashless ones to the queue's front, hashed to its back."""
        for b in ordered:
            self._ev("free", b, self.ref[b] - 1)
        first: list[int] = []
        last: list[int] = []
        for b in ordered:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (first if self.hash[b] is None or not self.caching else last).append(b)
        for b in reversed(first):  # FreeKVCacheBlockQueue.prepend_n keeps the list's order
            self.free[b] = None
            self.free.move_to_end(b, last=False)
        for b in last:
            self.free[b] = None
        self.num_cached_free += sum(self.hash[b] is not None for b in first + last)

    def insert_hash(self, h: int, b: int) -> None:
        """`BlockPool._insert_block_hash`: b now also answers for h (duplicates kept)."""
        if self.hash[b] == h:
            return
        self._ev("hash", b, self.ref[b], h)
        assert self.hash[b] is None, f"block {b} hashed twice; this is a bug in the vLLM model"
        self.hash[b] = h
        self.cached.setdefault(h, {})[b] = None

    def reset_prefix_cache(self) -> bool:
        """`BlockPool.reset_prefix_cache`: only when no block is held."""
        if len(self.free) != len(self.ref) - 1:
            return False
        self.cached.clear()
        self.hash = [None] * len(self.ref)
        self.num_cached_free = 0
        return True
