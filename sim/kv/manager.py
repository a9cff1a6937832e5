"""KV manager: request → blocks bookkeeping on top of the pool (reservations, reuse, rewind).

Per request r it owns `blocks[r]` (logical order) and `reserved[r]` = C, the KV slots reserved:

    blocks:   [ shared prefix (read-only) | own blocks ........................ ]
    slots:    0 ......... reused ........ committed ...... committed+W ... C ... A*B
              '-- hits --'                                                  A = ceil(C/B)

Every allocation is check-then-commit: a False/None return leaves everything untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.kv.events import EventLog
from sim.kv.hashing import chain_hashes
from sim.kv.pool import BlockPool


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    full: tuple[int, ...]  # cached full blocks matched, in order
    hashes: tuple[int, ...]
    partial_src: int = -1  # cached block whose first `partial_len` tokens match, or -1
    partial_len: int = 0


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, reuse: str, events: EventLog,
                 null_block: bool = False, nocopy_exclusive: bool = True,
                 hash_kind: str = "blake2b") -> None:
        self.pool = BlockPool(num_blocks, block_size, events, null_block)
        self.B = block_size
        self.reuse = reuse
        self.nocopy_exclusive = nocopy_exclusive
        self.blocks: dict[int, list[int]] = {}
        self.reserved: dict[int, int] = {}
        self.shared: dict[int, int] = {}
        self.hashed: dict[int, list[int]] = {}  # hashes of r's leading full blocks
        self.hash_kind = hash_kind
        # (block, first differing token index) of the last match whose hash hit a block with
        # other content: the prefix chain is inconsistent (a collision). The scheduler reports it.
        self.collision: tuple[int, int] | None = None

    # -- prefix reuse -----------------------------------------------------------------------
    def match(self, tokens: np.ndarray, prefill_len: int) -> tuple[PrefixMatch, int]:
        """Longest cached prefix of tokens[:prefill_len-1] (the last prompt token is recomputed).

        Returns the match and the number of tokens it covers.
        """
        if self.reuse == "off" or prefill_len < 2:
            return PrefixMatch((), ()), 0
        limit = prefill_len - 1
        hashes = chain_hashes(tokens, self.B, limit // self.B, kind=self.hash_kind)
        full: list[int] = []
        self.collision = None
        for i, h in enumerate(hashes):
            b = self.pool.cached.get(h)
            if b is None:
                break
            want = tokens[i * self.B:(i + 1) * self.B]
            if self.collision is None and not np.array_equal(self.pool.block_tokens[b], want):
                diff = int(np.flatnonzero(self.pool.block_tokens[b] != want)[0])
                self.collision = (b, i * self.B + diff)
            full.append(b)
        hs = tuple(hashes[: len(full)])
        n = len(full) * self.B
        if self.reuse == "full" or n >= limit:
            return PrefixMatch(tuple(full), hs), n
        src, m = self._partial(tokens[n:limit], hs[-1] if hs else 0)
        return PrefixMatch(tuple(full), hs, src, m), n + m

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
        pool, B = self.pool, self.B
        nocopy = match.partial_src >= 0 and self.reuse == "partial-nocopy"
        copy_src = match.partial_src if match.partial_src >= 0 and not nocopy else -1
        taken = list(match.full) + ([match.partial_src] if nocopy else [])
        fresh = max(0, -(-slots // B) - len(taken))
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
        self.reserved[r] = slots
        self.shared[r] = len(match.full)
        self.hashed[r] = list(match.hashes)
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
        """Give back `slots` rejected/unused slots; trailing blocks no longer needed are freed."""
        self.reserved[r] -= slots
        keep = max(-(-self.reserved[r] // self.B), self.shared[r])
        while len(self.blocks[r]) > keep:
            self.pool.release(self.blocks[r].pop(), r, "rewind")

    def register(self, r: int, tokens: np.ndarray, committed: int) -> None:
        """Publish r's fully committed blocks to the prefix cache (none without reuse: an engine
        with prefix caching off hashes nothing, and nothing could ever match)."""
        if self.reuse == "off":
            return
        done = self.hashed[r]
        n_full = min(committed // self.B, len(self.blocks[r]))
        if n_full <= len(done):
            return
        parent = done[-1] if done else 0
        start = len(done) * self.B
        new = chain_hashes(tokens[start: n_full * self.B], self.B, n_full - len(done), parent,
                           kind=self.hash_kind)
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
