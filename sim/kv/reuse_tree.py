"""TensorRT-LLM's block reuse on the radix tree (docs/fidelity.md, "Block reuse").

Transcribed from cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp:
`WindowBlockManager::loadOrAllocateBlocks` (match and take), `KVCacheBlock::findMatchingBlock`
(exact key, else the longest partial match), `WindowBlockManager::storeBlocks` (store) and
`WindowBlockManager::findNewContextBlock` (the capacity scheduler's delay for reuse).

    prompt   [ t0 .. t3 | t4 .. t7 | t8 t9 | t10 ]   last token never matched
    keys     [  full    |  full    | tail  ]
    lookup   exact key → follow; else (partial reuse on) the child sharing the longest
             prefix; a partial match ends the walk
"""

from __future__ import annotations

import numpy as np

from sim.kv.pool import BlockPool
from sim.kv.prefix import PrefixMatch
from sim.kv.radix import ROOT, common_prefix, key_of


class TreeReuse:
    """`partial`: enable_partial_reuse; `copy`: copy_on_partial_reuse; `exclusive`: a partial
    match without copy takes only a block nobody holds (off only in the append_into_shared
    fault)."""

    def __init__(self, pool: BlockPool, block_size: int, partial: bool, copy: bool,
                 exclusive: bool = True) -> None:
        assert pool.tree is not None, "TreeReuse needs a pool built with the reuse tree"
        self.pool, self.tree, self.B = pool, pool.tree, block_size
        self.partial, self.copy, self.exclusive = partial, copy, exclusive

    def match(self, tokens: np.ndarray, prefill_len: int) -> tuple[PrefixMatch, int]:
        """Longest cached prefix of tokens[:prefill_len-1] ("the last token can't be
        recovered"); returns the match and the number of tokens it covers."""
        limit, B, tree = prefill_len - 1, self.B, self.tree
        node, full = ROOT, []
        for i in range(0, limit, B):
            want = tokens[i:min(i + B, limit)]
            b = tree.child(node, key_of(want))
            if b >= 0 and len(want) == B:
                full.append(b)
                node = b
                continue
            m = len(want)
            if b < 0:  # no exact key: partial reuse looks for the longest shared prefix
                b, m = self._best_partial(node, want) if self.partial else (-1, 0)
                if b < 0:
                    break
            hashes = tuple(tree.hash[f] for f in full)
            return PrefixMatch(tuple(full), hashes, b, m, self._in_place(b)), i + m
        return PrefixMatch(tuple(full), tuple(tree.hash[f] for f in full)), len(full) * B

    def _best_partial(self, node: int, want: np.ndarray) -> tuple[int, int]:
        """The first child (in storage order) sharing the most tokens with `want`; without
        copy only an unused leaf may be taken."""
        best, best_m = -1, 0
        for b in self.tree.kids(node).values():
            if self.copy or not self.exclusive or self._unused_leaf(b):
                m = common_prefix(self.tree.tokens[b], want)
                if m > best_m:
                    best, best_m = b, m
        return best, best_m

    def _unused_leaf(self, b: int) -> bool:
        return self.pool.refcount[b] == 0 and self.tree.is_leaf(b)

    def _in_place(self, b: int) -> bool:
        """Copied only when in use or not a leaf; an unused leaf is taken as it is."""
        return self._unused_leaf(b) or not (self.copy or self.exclusive)

    def fits(self, match: PrefixMatch, fresh: int) -> bool:
        taken = list(match.full) + ([match.partial_src] if match.in_place else [])
        return fresh + sum(1 for b in taken if self.pool.refcount[b] == 0) <= self.pool.num_free

    def take(self, r: int, match: PrefixMatch, fresh: int) -> list[int]:
        """Claim the match and allocate the rest, in block order; a copy's target is the
        first fresh block."""
        pool, src = self.pool, match.partial_src
        for b in match.full:
            pool.touch(b, r)
        out = list(match.full)
        if src >= 0 and (match.in_place or pool.free.peek() == src):
            # getFreeBlock may hand back the source itself: copied onto itself, it is in effect
            # taken in place (its tokens stay, its descendants leave the tree)
            pool.take_in_place(src, r)
            out.append(src)
            fresh -= not match.in_place
        elif src >= 0:
            own = pool.allocate(1, r) or []
            pool.events.emit("copy", own[0], r, 1, src=src, num_tokens=match.partial_len)
            out += own
            fresh -= 1
        return out + (pool.allocate(fresh, r) or [])

    def store(self, blocks: list[int], tokens: np.ndarray, n: int, tail: bool) -> None:
        """Store a request's blocks holding tokens[:n]: follow the keys already in the tree;
        from the first that is not, hang the request's own blocks. `tail`: the last,
        partly filled block too (at release), else full blocks only (end of context)."""
        B, node = self.B, ROOT
        nb = min(n // B + (1 if tail and n % B else 0), len(blocks))
        for i in range(nb):
            want = tokens[i * B:min((i + 1) * B, n)]
            c = self.tree.child(node, key_of(want))
            if c < 0:
                for j in range(i, nb):
                    self.pool.store(node, blocks[j], np.array(tokens[j * B:min((j + 1) * B, n)]))
                    node = blocks[j]
                return
            node = c

    def new_context_block(self, tokens: np.ndarray, n: int) -> bytes | None:
        """The prompt up to and including its first full block not in the tree, or None when
        every full block is cached (`findNewContextBlock`)."""
        node, B = ROOT, self.B
        for i in range(n // B):
            c = self.tree.child(node, key_of(tokens[i * B:(i + 1) * B]))
            if c < 0:
                return key_of(tokens[:(i + 1) * B])
            node = c
        return None
