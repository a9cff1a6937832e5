"""KV pool and manager: exact block ids, event logs, reservations, rewind, reuse, eviction.

Reuse here is the flat hash map (the `vllm-v1` profile); TensorRT-LLM's reuse tree is held by
tests/unit/test_kv_trtllm.py."""

import numpy as np
import pytest

from sim.kv import EventLog, KVManager
from sim.kv.pool import PoolIntegrityError


def mgr(n=8, B=4, reuse="partial-copy", **kw):
    return KVManager(n, B, reuse, EventLog(), **kw)


def log(m):
    return [(e.event, e.block, e.request, e.refcount) for e in m.pool.events.drain()
            if e.event != "hash"]


def test_reserve_allocates_when_crossing_a_block_and_rewind_frees_the_tail():
    m = mgr()
    match, hit = m.match(np.arange(6), 6)
    assert hit == 0 and m.admit(0, match, 6)
    assert m.blocks[0] == [0, 1] and m.reserved[0] == 6
    assert m.reserve(0, 4)  # C = 10 -> 3 blocks
    assert m.blocks[0] == [0, 1, 2]
    m.rewind(0, 3)  # C = 7 -> 2 blocks
    assert m.blocks[0] == [0, 1] and m.reserved[0] == 7
    assert log(m) == [("alloc", 0, 0, 1), ("alloc", 1, 0, 1), ("alloc", 2, 0, 1),
                      ("rewind", 2, 0, 0)]


def test_failed_allocation_changes_nothing():
    m = mgr(n=2)
    match, _ = m.match(np.arange(8), 8)
    assert m.admit(0, match, 8)
    m.pool.events.drain()
    assert not m.reserve(0, 1)
    assert m.blocks[0] == [0, 1] and m.reserved[0] == 8 and log(m) == []
    m2 = mgr(n=1)
    assert not m2.admit(0, m2.match(np.arange(8), 8)[0], 8)
    assert m2.pool.num_free == 1 and not m2.holds(0)


def test_full_block_reuse_never_covers_the_last_prompt_token():
    m = mgr(reuse="full")
    toks = np.arange(100, 108)  # exactly 2 blocks
    m.admit(0, m.match(toks, 8)[0], 8)
    m.register(0, toks, 8)
    m.free(0)
    match, hit = m.match(toks, 8)
    assert hit == 4 and match.full == (0,)  # block 1 would cover the last token
    longer = np.arange(100, 110)
    match, hit = m.match(longer, 10)
    assert hit == 8 and match.full == (0, 1)


def test_lru_evicts_least_recently_freed_and_drops_its_hash():
    m = mgr(n=3, reuse="full")
    a, b = np.arange(0, 5), np.arange(50, 55)
    m.admit(0, m.match(a, 5)[0], 5)  # blocks 0, 1
    m.register(0, a, 5)
    m.free(0)  # frees 1 then 0: free queue [2, 1, 0]
    m.admit(1, m.match(b, 5)[0], 5)  # takes 2 and 1
    assert m.blocks[1] == [2, 1]
    assert m.match(a, 5)[1] == 4  # block 0 (hashed) still cached
    m.register(1, b, 5)
    m.free(1)
    c = np.arange(90, 99)
    m.admit(2, m.match(c, 9)[0], 9)  # needs 3: evicts 0 first
    assert m.blocks[2] == [0, 1, 2]
    assert m.match(a, 5)[1] == 0
    m.pool.check_integrity()  # incl. the cached-free count kept in step


def test_partial_copy_copies_into_a_fresh_block():
    m = mgr(reuse="partial-copy")
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.admit(0, m.match(a, 9)[0], 9)
    m.register(0, a, 8)
    b = np.array([1, 2, 3, 4, 5, 6, 0, 0, 0])
    match, hit = m.match(b, 9)
    assert (match.full, match.partial_src, match.partial_len, hit) == ((0,), 1, 2, 6)
    m.pool.events.drain()
    assert m.admit(1, match, 9)
    ev = [(e.event, e.block, e.src, e.num_tokens) for e in m.pool.events.drain()]
    assert ev == [("reuse", 0, -1, 0), ("reuse", 1, -1, 0), ("alloc", 3, -1, 0),
                  ("alloc", 4, -1, 0), ("copy", 3, 1, 2), ("free", 1, -1, 0)]
    assert m.blocks[1] == [0, 3, 4] and m.shared[1] == 1


def test_partial_nocopy_takes_only_an_unshared_block_unless_faulty():
    for exclusive, want in ((True, -1), (False, 1)):
        m = mgr(reuse="partial-nocopy", nocopy_exclusive=exclusive)
        a = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
        m.admit(0, m.match(a, 9)[0], 9)
        m.register(0, a, 8)  # request 0 still holds blocks 0, 1
        match, _ = m.match(np.array([1, 2, 3, 4, 5, 6, 0, 0, 0]), 9)
        assert match.partial_src == want


def test_refcounts_and_integrity():
    m = mgr(reuse="full")
    a = np.arange(9)
    m.admit(0, m.match(a, 9)[0], 9)
    m.register(0, a, 8)
    m.admit(1, m.match(a, 9)[0], 9)
    assert m.blocks[1][:2] == [0, 1] and m.pool.refcount[0] == 2
    m.pool.check_integrity()
    m.free(0)
    m.free(1)
    assert m.pool.num_free == 8
    with pytest.raises(PoolIntegrityError, match="bug in the KV manager"):
        m.pool.release(0, 0)


def test_null_block_is_never_allocated():
    m = mgr(n=3, null_block=True)
    assert m.admit(0, m.match(np.arange(8), 8)[0], 8)
    assert m.blocks[0] == [1, 2] and m.pool.num_free == 0


def test_regression_partial_copy_source_is_not_evicted_by_its_own_copy_target():
    """Found by the I10 checker on scenarios/default.toml: the copy source sat at the head of
    the LRU free queue, allocating the copy target evicted it, and the copy read stale slots."""
    m = mgr(n=4, reuse="partial-copy")
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.admit(0, m.match(a, 9)[0], 9)  # blocks 0, 1, 2
    m.register(0, a, 8)
    m.free(0)  # free queue: 3, 2, 1, 0 -> block 1 (the partial source) would go third
    match, hit = m.match(np.array([1, 2, 3, 4, 5, 6, 0, 0, 0]), 9)
    assert (match.partial_src, hit) == (1, 6)
    m.pool.events.drain()
    assert m.admit(1, match, 9)
    ev = [(e.event, e.block, e.src) for e in m.pool.events.drain()]
    assert ev == [("reuse", 0, -1), ("reuse", 1, -1), ("alloc", 3, -1), ("alloc", 2, -1),
                  ("copy", 3, 1), ("free", 1, -1)]
    assert m.blocks[1] == [0, 3, 2] and 1 in m.pool.block_hash


def test_partial_copy_needs_room_for_the_pinned_source():
    m = mgr(n=3, reuse="partial-copy")
    a = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.admit(0, m.match(a, 9)[0], 9)
    m.register(0, a, 8)
    m.free(0)
    match, _ = m.match(np.array([1, 2, 3, 4, 5, 6, 0, 0, 0]), 9)
    m.pool.events.drain()
    assert not m.admit(1, match, 9)  # 2 fresh + 2 revived > 3 free: nothing changes
    assert m.pool.events.drain() == [] and m.pool.num_free == 3
