"""TensorRT-LLM's own KV cache manager tests, transcribed, run against kvsim's reuse tree.

Each test names the TensorRT-LLM test it transcribes, from
cpp/tests/unit_tests/batch_manager/kvCacheManagerTest.cpp (NVIDIA/TensorRT-LLM, commit
000a01de66f0eab4ab05640711f0253f50f5209c). Block ids, reused lengths
(`getContextCurrentPosition`) and free counts are the C++ test's expected values.

The C++ calls map to kvsim's like this:
    blockManager.addSequence(seq, promptLen, ceilDiv(promptLen, B), req)
                                    -> kv.match(tokens, promptLen) + kv.admit(r, match, promptLen)
    llmRequest->addNewToken(t)      -> append t to the request's tokens (no KV call)
    blockManager.releaseBlocks(seq, req)
                                    -> kv.register(r, tokens, len(tokens) - 1, tail=True)
                                       + kv.free(r)
    getNumFreeBlocks / getNumAllocatedBlocks -> pool.num_free / pool.num_used
"""

from __future__ import annotations

import numpy as np

from sim.kv import EventLog, KVManager


class Requests:
    """A BlockManager with reuse on (partial reuse and copy on, the C++ defaults)."""

    def __init__(self, blocks: int, B: int, reuse: str = "partial-copy") -> None:
        self.kv = KVManager(blocks, B, reuse, EventLog(), tree=True)
        self.tokens: dict[int, list[int]] = {}

    def add(self, r: int, tokens: list[int]) -> tuple[list[int], int]:
        """addSequence: returns (cache block ids, context current position)."""
        arr = np.array(tokens, np.int32)
        match, hit = self.kv.match(arr, len(tokens))
        assert self.kv.admit(r, match, len(tokens))
        self.tokens[r] = list(tokens)
        return list(self.kv.blocks[r]), hit

    def release(self, r: int, tokens: list[int] | None = None) -> None:
        """releaseBlocks(seq, llmRequest): store what the request's tokens say, then free."""
        toks = self.tokens.pop(r) if tokens is None else tokens
        self.kv.register(r, np.array(toks, np.int32), len(toks) - 1, tail=True)
        self.kv.free(r)
        self.kv.pool.check_integrity()

    @property
    def free(self) -> int:
        return self.kv.pool.num_free

    @property
    def allocated(self) -> int:
        return self.kv.pool.num_used


def test_block_manager_reuse_test():
    """BlockManagerReuseTest: tokensPerBlock 4, 8 primary blocks."""
    m = Requests(8, 4)
    assert m.free == 8
    # add request and then remove it; blocks 0, 1, 2 stored ([0..3], [4..7], [8, 9])
    assert m.add(0, list(range(9))) == ([0, 1, 2], 0)
    m.tokens[0] += [9, 10]
    assert (m.allocated, m.free) == (3, 5)
    m.release(0)
    assert (m.allocated, m.free) == (0, 8)
    # same tokens: reuse blocks 0, 1 and get new block 3; block 3 matches block 2: freed
    assert m.add(1, list(range(9))) == ([0, 1, 3], 2 * 4)
    m.tokens[1] += [9, 10]
    assert (m.allocated, m.free) == (3, 5)
    m.release(1)
    assert (m.allocated, m.free) == (0, 8)
    # [0..9]: reuse blocks 0, 1, 2(p) :: p = partial reuse
    assert m.add(0, list(range(10))) == ([0, 1, 2], 10 - 1)
    assert (m.allocated, m.free) == (3, 5)
    # [0..10]: reuse blocks 0, 1 and get new block 4
    assert m.add(1, list(range(11))) == ([0, 1, 4], 2 * 4)
    m.tokens[1] += [10]
    assert (m.allocated, m.free) == (4, 4)
    m.release(0)
    assert (m.allocated, m.free) == (3, 5)
    m.release(1)
    assert (m.allocated, m.free) == (0, 8)
    # fewer tokens [0..4]: reuse block 0, get new block 5
    assert m.add(2, list(range(5))) == ([0, 5], 4)
    m.tokens[2] += [5]
    assert (m.allocated, m.free) == (2, 6)
    # more tokens [0..9, 11]: reuse blocks 0, 1, 4(p)
    assert m.add(3, [*range(10), 11]) == ([0, 1, 4], 11 - 1)
    m.tokens[3] += [11]
    assert (m.allocated, m.free) == (4, 4)  # one block used by both
    m.release(2)
    m.release(3)
    assert (m.allocated, m.free) == (0, 8)
    # 11 tokens, then released as a shorter request: block 4 freed, not stored
    assert m.add(4, [*range(10), 12]) == ([0, 1, 4], 11 - 1)
    assert (m.allocated, m.free) == (3, 5)
    m.release(4, list(range(9)))
    assert (m.allocated, m.free) == (0, 8)
    # the same 11 tokens again: no discarded tokens reused; blocks 0, 1, 2(p)
    assert m.add(4, [*range(10), 12]) == ([0, 1, 2], 11 - 2)
    assert (m.allocated, m.free) == (3, 5)
    m.release(4)
    assert (m.allocated, m.free) == (0, 8)
    # the whole pool with incidental reuse of the first token (all zeros)
    blocks, pos = m.add(5, [0] * (8 * 4 - 1))
    assert pos == 1 and (m.allocated, m.free) == (8, 0)
    m.tokens[5] += [0]
    m.release(5)
    assert (m.allocated, m.free) == (0, 8)
    # one token: no reuse (the last input token is never reused)
    assert m.add(6, [0])[1] == 0
    assert (m.allocated, m.free) == (1, 7)
    m.release(6)
    assert (m.allocated, m.free) == (0, 8)


class Sequences(Requests):
    """A KVCacheManager with reuse on: addSequence, addToken, storeContextBlocks,
    removeSequence (kvCacheManagerTest.cpp at commit fb6d3613550da05b61d684d53f1e6c577ebd8265).
        addToken(r)           -> kv.reserve(r, 1) (a block when the tokens cross a boundary)
        storeContextBlocks(r) -> kv.register(r, tokens, len(tokens) - 1) (full blocks only)
        removeSequence(r)     -> releaseBlocks above
    """

    def add_token(self, r: int, token: int) -> bool:
        self.tokens[r].append(token)
        return self.kv.reserve(r, 1)

    def store_context(self, r: int) -> None:
        toks = np.array(self.tokens[r], np.int32)
        self.kv.register(r, toks, len(toks) - 1)

    def try_add(self, r: int, tokens: list[int]) -> bool:
        arr = np.array(tokens, np.int32)
        return self.kv.admit(r, self.kv.match(arr, len(tokens))[0], len(tokens))


def test_kv_cache_manager_leaf_block_test():
    """KVCacheManagerLeafBlockTest: 4 blocks of 4 tokens."""
    m = Sequences(4, 4)
    m.add(0, [0, 1, 2, 3])
    m.store_context(0)  # [0, 1, 2] is not a full block: nothing stored
    assert m.add_token(0, 0)
    m.release(0)
    # block 1 is not reused: [0, 1, 2, 3] shares no prefix with [1, 1, 2]
    assert m.add(1, [1, 1, 2, 3]) == ([2], 0)
    m.add(2, [2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])  # the remaining 3 blocks
    m.release(1)
    m.release(2)
    blocks, pos = m.add(3, [2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert pos == 11 and m.free == 1
    assert m.add_token(3, 0)
    assert m.free == 0
    assert not m.try_add(4, [42])  # addSequence throws: no free block


def test_kv_cache_manager_decode_block_priority_test():
    """KVCacheManagerDecodeBlockPriorityTest: 8 blocks of 4 tokens; the retention configs'
    priorities are set on the blocks as `claimBlock` sets them."""
    m = Sequences(8, 4)
    prio = m.kv.pool.free.set_priority
    m.add(0, list(range(12)))  # context and decode priority 90
    assert m.free == 5
    assert m.add_token(0, 0)  # block 3
    assert m.free == 4
    for b in m.kv.blocks[0]:
        prio(b, 90)
    m.add(1, list(range(12, 24)))  # context and decode priority 5
    assert m.free == 1
    assert m.add_token(1, 0)  # block 7
    assert m.free == 0
    for b in m.kv.blocks[1]:
        prio(b, 5)
    m.release(0)
    m.release(1)
    assert m.free == 8
    # no reuse: evicts 7, 6, 5 (lowest priority, in the order released)
    assert m.add(2, list(range(24, 36))) == ([7, 6, 5], 0)
    m.release(2)
    # blocks 0, 1 reused, block 2 partly: the most is the prompt minus its last token
    assert m.add(3, list(range(12)))[1] == 11


# -- behaviours the C++ tests above do not pin, held to the code they cite ---------------------

def events(m: Requests) -> list[tuple[str, int, int]]:
    return [(e.event, e.block, e.src) for e in m.kv.pool.events.drain() if e.event != "hash"]


def test_matching_compares_tokens_not_hashes():
    """`KVCacheBlock::findMatchingBlock` looks a child up by `BlockKey`, whose equality compares
    the tokens: a block whose hash label equals another prompt's is still no match."""
    from sim.kv.radix import ROOT, chain_hash, key_of
    m = Requests(8, 4)
    m.add(0, [5, 40, 7, 9, 1])
    m.release(0)
    tree = m.kv.pool.tree
    assert tree is not None and tree.child(ROOT, key_of(np.array([5, 40, 7, 9]))) == 0
    tree.hash[0] = chain_hash(0, key_of(np.array([36, 39, 7, 9])))  # a forced collision
    assert m.add(1, [36, 39, 7, 9, 1])[1] == 0


def test_a_partial_match_in_use_is_copied_and_an_unused_leaf_is_taken():
    """`loadOrAllocateBlocks`: copy when the block has references or children."""
    m = Sequences(8, 4)
    m.add(0, list(range(9)))  # blocks 0, 1, 2
    m.store_context(0)  # [0..3], [4..7] stored; request 0 still holds them
    m.kv.pool.events.drain()
    assert m.add(1, [0, 1, 2, 3, 4, 5, 99, 98]) == ([0, 3], 6)  # block 1 in use: copied to 3
    assert events(m) == [("reuse", 0, -1), ("alloc", 3, -1), ("copy", 3, 1)]
    m.release(0)  # block 1 is a free leaf now
    assert m.add(2, [0, 1, 2, 3, 4, 5, 6, 77, 66]) == ([0, 1, 4], 7)  # taken in place
    assert 1 not in m.kv.pool.tree  # request 2 overwrites its tail: it leaves the tree


def stored_chain() -> Requests:
    """Blocks 0 -> 1 stored ([0..3], [4, 5]) and free; block 0 made the next one taken (a
    lower retention priority, as `claimBlock` would set)."""
    m = Requests(3, 4)
    m.add(0, [0, 1, 2, 3, 4, 5])
    m.tokens[0] += [6]
    m.release(0)  # free queue 2, 1, 0
    m.kv.pool.free.set_priority(0, 0)
    assert list(m.kv.pool.free) == [0, 2, 1]
    m.kv.pool.events.drain()
    return m


def test_evicting_a_block_evicts_its_descendants():
    """`WindowBlockManager::getFreeBlock` calls `freeChildren`: the evicted block's subtree
    leaves the tree with it; the children stay in the free queue, content unreachable."""
    m = stored_chain()
    assert m.add(1, [20, 21, 22, 23]) == ([0], 0)
    assert events(m) == [("evict", 1, -1), ("evict", 0, -1), ("alloc", 0, -1)]
    assert 1 not in m.kv.pool.tree and 1 in m.kv.pool.free


def test_a_copy_whose_target_is_its_own_source_takes_it_in_place():
    """`loadOrAllocateBlocks` copies a partial match that is not a leaf into `getFreeBlock`'s
    block, the free queue's front; when that is the source itself, the copy leaves it as it
    was and its subtree leaves the tree: kvsim takes it in place."""
    m = stored_chain()
    assert m.add(1, [0, 1, 2, 9, 9]) == ([0, 2], 3)  # block 0 matched for 3 tokens
    assert events(m) == [("evict", 1, -1), ("reuse", 0, -1), ("alloc", 2, -1)]
    assert 0 not in m.kv.pool.tree and 1 not in m.kv.pool.tree


def test_a_rewound_block_returns_to_the_front():
    """`KVCacheManager::removeToken` -> `releaseLastBlock` -> `releaseBlock(block, true)`."""
    m = Sequences(6, 4)
    m.add(0, [1, 2, 3, 4])  # block 0; free queue 1..5
    assert m.kv.reserve(0, 5)  # C = 9: blocks 1, 2
    m.kv.rewind(0, 5)  # back to C = 4: 2 then 1 released to the front
    assert list(m.kv.pool.free) == [1, 2, 3, 4, 5]
    m.kv.free(0)  # a released sequence goes to the back
    assert list(m.kv.pool.free) == [1, 2, 3, 4, 5, 0]


def test_regression_evicting_the_root_of_a_long_chain_does_not_recurse():
    """A chain deeper than Python's recursion limit (one-token blocks, a long prompt) is
    unlinked in one loop when its first block is evicted."""
    m = Requests(2100, 1)
    m.add(0, list(range(2000)))
    m.release(0)
    m.kv.pool.free.set_priority(0, 0)  # the chain's root is the next block taken
    assert m.add(1, [7000, 7001])[0][0] == 0
    assert len(m.kv.pool.tree.parent) == 0
