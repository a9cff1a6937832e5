"""Model-based test of the KV manager and pool: the real `KVManager` runs beside a tiny plain
model of what each request holds, under random admit/reserve/commit/rewind/register/free.

The model only counts (reserved slots C, committed slots, blocks = max(ceil(C/B), shared
prefix)); the pool invariants are checked against the manager's own lists after every rule.
Records are plain ints and tuples so a shrunk failure's printed steps paste into a test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from sim.kv import EventLog, KVManager


@dataclass
class Held:
    """The model of one admitted request."""

    tokens: tuple[int, ...]  # prompt + the outputs it will commit
    reserved: int  # C
    committed: int
    shared: int  # leading blocks reused from the cache (read-only)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PoolMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(b=st.integers(1, 4), n=st.integers(2, 8),
                reuse=st.sampled_from(["off", "full", "partial-copy", "partial-nocopy"]),
                null=st.booleans(), tree=st.booleans())
    def setup(self, b: int, n: int, reuse: str, null: bool, tree: bool) -> None:
        self.B, self.null = b, null
        self.kv = KVManager(n, b, reuse, EventLog(), null_block=null, tree=tree)
        self.model: dict[int, Held] = {}
        self.next_id = 0

    # -- rules -------------------------------------------------------------------------------
    @rule(target=requests, tokens=st.lists(st.integers(1, 2), min_size=1, max_size=12),
          prompt=st.integers(1, 12), extra=st.integers(0, 3))
    def admit(self, tokens: list[int], prompt: int, extra: int):  # type: ignore[no-untyped-def]
        p = min(prompt, len(tokens))
        arr = np.array(tokens, dtype=np.int32)
        match, hit = self.kv.match(arr, p)
        assert hit <= p - 1 or hit == 0, "reuse covered the last prompt token"
        pool = self.kv.pool
        stored = pool.tree.tokens if pool.tree is not None else pool.block_tokens
        for i, b in enumerate(match.full):
            want = arr[i * self.B:(i + 1) * self.B]
            assert list(stored[b]) == list(want), "matched wrong content"
        if match.partial_src >= 0:
            n = len(match.full) * self.B
            have = list(stored[match.partial_src][:match.partial_len])
            assert have == list(arr[n:n + match.partial_len]), "partial match of wrong content"
        r, before = self.next_id, self._snapshot()
        if not self.kv.admit(r, match, p + extra):
            assert self._snapshot() == before, "a failed admit changed state"
            return multiple()
        self.next_id += 1
        self.model[r] = Held(tuple(tokens), p + extra, hit, len(match.full))
        return r

    @rule(r=requests, slots=st.integers(1, 5))
    def reserve(self, r: int, slots: int) -> None:
        before = self._snapshot()
        if self.kv.reserve(r, slots):
            self.model[r].reserved += slots
        else:
            assert self._snapshot() == before, "a failed reserve changed state"

    @rule(r=requests, n=st.integers(1, 5))
    def commit_and_register(self, r: int, n: int) -> None:
        m = self.model[r]
        m.committed = min(m.committed + n, m.reserved, len(m.tokens))
        self.kv.register(r, np.array(m.tokens, dtype=np.int32), m.committed)

    @rule(r=requests, n=st.integers(0, 5))
    def rewind(self, r: int, n: int) -> None:
        m = self.model[r]
        n = min(n, m.reserved - m.committed)  # only uncommitted (rejected) slots go back
        self.kv.rewind(r, n)
        m.reserved -= n

    @rule(r=consumes(requests), store=st.booleans())
    def free(self, r: int, store: bool) -> None:
        if store:  # TRT-LLM's releaseBlocks: the partly filled last block is stored too
            m = self.model[r]
            self.kv.register(r, np.array(m.tokens, dtype=np.int32), m.committed, tail=True)
        self.kv.free(r)
        del self.model[r]

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def model_agrees(self) -> None:
        for r, m in self.model.items():
            assert self.kv.reserved[r] == m.reserved
            assert len(self.kv.blocks[r]) == max(_cdiv(m.reserved, self.B), m.shared), r

    @invariant()
    def free_plus_used_is_total(self) -> None:
        pool = self.kv.pool
        used = sum(1 for c in pool.refcount if c > 0)
        assert used + pool.num_free == pool.num_usable
        pool.check_integrity()

    @invariant()
    def refcount_is_holders(self) -> None:
        holders = [0] * self.kv.pool.num_blocks
        for blocks in self.kv.blocks.values():
            for b in blocks:
                holders[b] += 1
        assert holders == self.kv.pool.refcount

    @invariant()
    def free_queue_iff_unreferenced(self) -> None:
        pool = self.kv.pool
        first = 1 if self.null else 0
        for b in range(first, pool.num_blocks):
            assert (b in pool.free) == (pool.refcount[b] == 0), b
        assert 0 not in pool.free or not self.null, "the null block was handed out"

    @invariant()
    def only_prefix_blocks_are_shared(self) -> None:
        owner: dict[int, int] = {}
        for r, blocks in self.kv.blocks.items():
            for i, b in enumerate(blocks):
                if i >= self.kv.shared[r]:
                    assert owner.setdefault(b, r) == r, f"block {b} written by two requests"

    @precondition(lambda self: not self.model)
    @invariant()
    def idle_means_all_free(self) -> None:
        assert self.kv.pool.num_free == self.kv.pool.num_usable

    def _snapshot(self) -> tuple:
        pool, kv = self.kv.pool, self.kv
        cached = sorted(pool.tree.parent.items()) if pool.tree is not None else \
            sorted(pool.cached.items())
        return (tuple(pool.refcount), tuple(pool.free), tuple(cached),
                {r: tuple(b) for r, b in kv.blocks.items()}, dict(kv.reserved),
                len(pool.events.events))


TestPool = PoolMachine.TestCase
