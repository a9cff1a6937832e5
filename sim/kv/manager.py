"""KV manager: request → blocks bookkeeping on top of the pool (reservations, reuse, rewind).

Per request r it owns `blocks[r]` (logical order) and `reserved[r]` = C, the KV slots reserved:

    blocks:   [ shared prefix (read-only) | own blocks ........................ ]
    slots:    0 ......... reused ........ committed ...... committed+W ... C ... A*B
              '-- hits --'                                                  A = ceil(C/B)

Two ways of caching block contents, picked by the profile (`Switches.reuse_tree`):
TensorRT-LLM's radix tree matched by tokens (`sim/kv/reuse_tree.py`), or a flat hash chain
map of full blocks (the `vllm-v1-legacy` profile, below).
Every allocation is check-then-commit: a False/None return leaves everything untouched.
"""

from __future__ import annotations

import numpy as np

from sim.kv.events import EventLog
from sim.kv.hashing import chain_hashes
from sim.kv.pool import BlockPool
from sim.kv.prefix import PrefixMatch
from sim.kv.reuse_tree import TreeReuse


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, reuse: str, events: EventLog,
                 null_block: bool = False, nocopy_exclusive: bool = True,
                 tree: bool = False) -> None:
        self.pool = BlockPool(num_blocks, block_size, events, null_block, tree)
        self.B = block_size
        self.reuse = reuse
        self.nocopy_exclusive = nocopy_exclusive
        self.tree = TreeReuse(self.pool, block_size, partial=reuse.startswith("partial"),
                              copy=reuse != "partial-nocopy",
                              exclusive=nocopy_exclusive) if tree else None
        self.blocks: dict[int, list[int]] = {}
        self.reserved: dict[int, int] = {}
        self.shared: dict[int, int] = {}
        self.hashed: dict[int, list[int]] = {}  # hashes of r's leading full blocks (hash map)

    # -- prefix reuse -----------------------------------------------------------------------
    def match(self, tokens: np.ndarray, prefill_len: int) -> tuple[PrefixMatch, int]:
        """Longest cached prefix of tokens[:prefill_len-1] (the last prompt token is recomputed).

        Returns the match and the number of tokens it covers.
        """
        if self.reuse == "off" or prefill_len < 2:
            return PrefixMatch((), ()), 0
        if self.tree is not None:
            return self.tree.match(tokens, prefill_len)
        limit = prefill_len - 1
        hashes = chain_hashes(tokens, self.B, limit // self.B)
        full: list[int] = []
        for h in hashes:
            b = self.pool.cached.get(h)
            if b is None:
                break
            full.append(b)
        hs = tuple(hashes[: len(full)])
        n = len(full) * self.B
        if self.reuse == "full" or n >= limit:
            return PrefixMatch(tuple(full), hs), n
        src, m = self._partial(tokens[n:limit], hs[-1] if hs else 0)
        return PrefixMatch(tuple(full), hs, src, m, self.reuse == "partial-nocopy"), n + m

    def new_context_block(self, tokens: np.ndarray, n: int) -> bytes | None:
        """The key of the first full block of tokens[:n] not cached, or None (reuse tree only:
        the capacity scheduler's delay for reuse)."""
        if self.tree is None or self.reuse == "off":
            return None
        return self.tree.new_context_block(tokens, n)

    def _partial(self, want: np.ndarray, parent: int) -> tuple[int, int]:
        best, best_m = -1, 0
        for b in self.pool.children.get(parent, ()):
            have = self.pool.block_tokens[b][: len(want)]
            neq = np.flatnonzero(have != want[: len(have)])
            m = int(neq[0]) if len(neq) else len(have)
            if m > best_m and (self.reuse == "partial-copy" or not self.nocopy_exclusive
                               or self.pool.refcount[b] == 0):
                best, best_m = b, m
        return best, best_m

    # -- allocation -------------------------------------------------------------------------
    def admit(self, r: int, match: PrefixMatch, slots: int) -> bool:
        """Give r the matched prefix plus fresh blocks so C = slots. Check, then commit."""
        taken_n = len(match.full) + (match.partial_src >= 0 and match.in_place)
        fresh = max(0, -(-slots // self.B) - taken_n)
        if self.tree is not None:
            if not self.tree.fits(match, fresh):
                return False
            self.blocks[r] = self.tree.take(r, match, fresh)
        elif not self._take_hashed(r, match, fresh):
            return False
        self.reserved[r] = slots
        self.shared[r] = len(match.full)
        self.hashed[r] = list(match.hashes)
        return True

    def _take_hashed(self, r: int, match: PrefixMatch, fresh: int) -> bool:
        """The hash map's take: a copy's source is held while its target is allocated."""
        pool = self.pool
        nocopy = match.partial_src >= 0 and match.in_place
        copy_src = match.partial_src if match.partial_src >= 0 and not nocopy else -1
        taken = list(match.full) + ([match.partial_src] if nocopy else [])
        pinned = taken + ([copy_src] if copy_src >= 0 else [])
        if fresh + sum(1 for b in pinned if pool.refcount[b] == 0) > pool.num_free:
            return False
        for b in taken:
            pool.touch(b, r)
        if nocopy and self.nocopy_exclusive:
            pool.uncache(match.partial_src)  # r will overwrite its tail: no longer that content
        if copy_src >= 0:  # hold the source so allocating the copy target cannot evict it
            pool.touch(copy_src, r)
        own = pool.allocate(fresh, r) or []
        if copy_src >= 0:
            pool.events.emit("copy", own[0], r, 1, src=copy_src, num_tokens=match.partial_len)
            pool.release(copy_src, r)
        self.blocks[r] = taken + own
        return True

    def blocks_needed(self, r: int, extra_slots: int) -> int:
        return max(0, -(-(self.reserved[r] + extra_slots) // self.B) - len(self.blocks[r]))

    def reserve(self, r: int, slots: int) -> bool:
        """Grow r's reservation by `slots` (C += slots), allocating blocks as C crosses B."""
        need = self.blocks_needed(r, slots)
        if need:
            got = self.pool.allocate(need, r)
            if got is None:
                return False
            self.blocks[r].extend(got)
        self.reserved[r] += slots
        return True

    def rewind(self, r: int, slots: int) -> None:
        """Give back `slots` rejected/unused slots; trailing blocks no longer needed are freed.
        The reuse tree's engine returns such a block to the free queue's front
        (`releaseLastBlock`), to be taken next."""
        self.reserved[r] -= slots
        keep = max(-(-self.reserved[r] // self.B), self.shared[r])
        front = self.tree is not None
        while len(self.blocks[r]) > keep:
            self.pool.release(self.blocks[r].pop(), r, "rewind", front)

    def register(self, r: int, tokens: np.ndarray, committed: int, tail: bool = False) -> None:
        """Publish r's blocks holding tokens[:committed] to the prefix cache (none without
        reuse: an engine with prefix caching off stores nothing, and nothing could match).
        `tail`: at release the reuse tree stores the last, partly filled block too."""
        if self.reuse == "off":
            return
        if self.tree is not None:
            self.tree.store(self.blocks[r], tokens, committed, tail)
            return
        done = self.hashed[r]
        n_full = min(committed // self.B, len(self.blocks[r]))
        if n_full <= len(done):
            return
        parent = done[-1] if done else 0
        start = len(done) * self.B
        new = chain_hashes(tokens[start: n_full * self.B], self.B, n_full - len(done), parent)
        for i, h in enumerate(new, start=len(done)):
            self.pool.register(self.blocks[r][i], h, parent,
                               np.array(tokens[i * self.B:(i + 1) * self.B], dtype=np.int32))
            parent = h
        done.extend(new)

    def free(self, r: int) -> None:
        """Release every block of r, tail first (so the prefix stays cached longest)."""
        for b in reversed(self.blocks.pop(r)):
            self.pool.release(b, r)
        del self.reserved[r], self.shared[r], self.hashed[r]

    def holds(self, r: int) -> bool:
        return r in self.blocks
