"""TensorRT-LLM's block reuse tree (docs/fidelity.md, "Block reuse"): structure only.

Each cached block is a node whose children are keyed by their tokens, as
`KVCacheBlock::mNextBlocks` (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp) is keyed by
`BlockKey`, whose equality compares the tokens. A lookup compares tokens, so two prompts can
share a block only when their tokens are equal; the hash a node carries labels trace events.
A key may be shorter than the block (a partial tail block, stored when a request is released).

    ROOT ─ [t0..t3] ─ [t4..t7] ─ [t8 t9]        partial leaf
                   └─ [t4 t5 t6 x]              another branch

The tree does not own blocks: the pool decides when a block joins or leaves it.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROOT = -1


def key_of(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype=np.int32).tobytes()


def chain_hash(parent: int, key: bytes) -> int:
    """A stable 64-bit label for the block event log (never Python's hash())."""
    d = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    d.update(key)
    return int.from_bytes(d.digest(), "little")


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """`BlockKey::partialMatch`: the length of the tokens' common prefix."""
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


class RadixTree:
    __slots__ = ("children", "parent", "key", "tokens", "hash")

    def __init__(self) -> None:
        self.children: dict[int, dict[bytes, int]] = {ROOT: {}}
        self.parent: dict[int, int] = {}
        self.key: dict[int, bytes] = {}
        self.tokens: dict[int, np.ndarray] = {}
        self.hash: dict[int, int] = {ROOT: 0}

    def __contains__(self, b: int) -> bool:
        return b in self.parent

    def child(self, node: int, key: bytes) -> int:
        """The child of `node` whose tokens equal `key`, or -1."""
        kids = self.children.get(node)
        return kids.get(key, -1) if kids else -1

    def kids(self, node: int) -> dict[bytes, int]:
        return self.children.get(node, {})

    def is_leaf(self, b: int) -> bool:
        return not self.children.get(b)

    def insert(self, node: int, b: int, tokens: np.ndarray) -> int:
        """Hang block b (holding `tokens`) under `node`; returns b's hash label."""
        key = key_of(tokens)
        h = chain_hash(self.hash[node], key)
        self.children.setdefault(node, {})[key] = b
        self.parent[b], self.key[b], self.tokens[b], self.hash[b] = node, key, tokens, h
        return h

    def detach_leaf(self, b: int) -> None:
        """`KVCacheBlock::freeLeafBlock`: unlink a childless block from its parent."""
        kids = self.children[self.parent.pop(b)]
        del kids[self.key.pop(b)]
        del self.tokens[b], self.hash[b]
        self.children.pop(b, None)

    def remove_subtree(self, b: int) -> list[tuple[int, int]]:
        """`WindowBlockManager::freeChildren`: unlink b and all its descendants, every block
        after its descendants (a loop, not recursion: chains run thousands of blocks deep).
        Returns (block, hash) in that order."""
        order, stack = [], [b]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(self.kids(n).values())
        out = [(n, self.hash[n]) for n in reversed(order)]
        for n, _h in out:
            self.detach_leaf(n)
        return out
