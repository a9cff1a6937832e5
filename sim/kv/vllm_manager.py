"""vLLM's KV cache manager for one full-attention group, as vLLM 0.33.0 runs it
(vllm/v1/core/kv_cache_manager.py `KVCacheManager`; single_type_kv_cache_manager.py
`FullAttentionManager`; kv_cache_coordinator.py `UnitaryKVCacheCoordinator`).

`allocate_slots` grows a request's blocks per step, not per request (its docstring's layout):

    | comp | new_comp (prefix hit) | new (scheduled, drafts included) | lookahead (k slots) |
                                   '------------ to be computed -------'
           '------------------------ to be allocated ---------------------------------'

and hashes, at once, the blocks the step fills, capped at the request's known tokens (drafts
that may be rejected are never cached).
"""

from __future__ import annotations

from typing import Protocol

from sim.kv.vllm_pool import VllmPool


class Hashed(Protocol):
    """What the manager reads of a request (sim/sched/vllm.py `VRequest`)."""

    rid: int
    num_computed: int
    block_hashes: list[int]

    @property
    def num_tokens(self) -> int: ...


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class VllmKV:
    def __init__(self, num_blocks: int, block_size: int, caching: bool, max_model_len: int,
                 drop_last_block: bool = False) -> None:
        self.pool = VllmPool(num_blocks, block_size, caching)
        self.B = block_size
        self.caching = caching
        self.max_model_len = max_model_len
        # the legacy EAGLE rule: drop the last matched block (no lookahead block hashes)
        self.drop_last_block = drop_last_block
        self.blocks: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}  # blocks of the request already hashed

    def computed_blocks(self, r: Hashed) -> tuple[list[int], int]:
        """`get_computed_blocks`: the longest cached prefix, at most num_tokens - 1 (the last
        token is recomputed for its logits), in whole blocks."""
        if not self.caching:
            return [], 0
        hit: list[int] = []
        for h in r.block_hashes[:(r.num_tokens - 1) // self.B]:
            b = self.pool.first_cached(h)
            if b is None:
                break
            hit.append(b)
        if self.drop_last_block and hit:
            hit.pop()
        return hit, len(hit) * self.B

    def _to_allocate(self, r: Hashed, num_tokens: int, hit: list[int]) -> int:
        """`get_num_blocks_to_allocate`: new blocks, plus hit blocks that leave the queue."""
        need = _cdiv(num_tokens, self.B)
        held = len(self.blocks.get(r.rid, ()))
        return (max(need - held - len(hit), 0)
                + sum(self.pool.ref[b] == 0 for b in hit))

    def allocate_slots(self, r: Hashed, num_new: int, hit: list[int] = (),  # type: ignore[assignment]
                       lookahead: int = 0, admit: bool = False) -> bool:
        """Check, then commit; False changes nothing. `admit`: a waiting request, whose whole
        sequence must fit first (`full_sequence_must_fit`, vLLM's default for admission)."""
        pool, B = self.pool, self.B
        computed = min(r.num_computed + len(hit) * B, self.max_model_len)
        if admit:
            full = min(r.num_tokens, self.max_model_len)
            if self._to_allocate(r, full, hit) > pool.num_free:
                return False
        slots = min(computed + num_new + lookahead, self.max_model_len)
        if self._to_allocate(r, slots, hit) > pool.num_free:
            return False
        pool.req = r.rid
        mine = self.blocks.setdefault(r.rid, [])
        if hit:
            pool.touch(list(hit))
            mine.extend(hit)
            self.num_cached[r.rid] = len(hit)
        more = _cdiv(slots, B) - len(mine)
        if more > 0:
            mine.extend(pool.get_new_blocks(more))
        self.cache_blocks(r, min(computed + num_new, r.num_tokens))
        pool.req = -1
        return True

    def cache_blocks(self, r: Hashed, num_tokens: int) -> None:
        """Hash the request's blocks that `num_tokens` fills (and whose hash is known). The
        events keep the tag of the call they serve (none after a step: the driver's)."""
        if not self.caching:
            return
        done = self.num_cached.get(r.rid, 0)
        full = min(num_tokens, len(r.block_hashes) * self.B) // self.B
        if done >= full:
            return
        mine = self.blocks[r.rid]
        for i in range(done, full):
            self.pool.insert_hash(r.block_hashes[i], mine[i])
        self.num_cached[r.rid] = full

    def free(self, rid: int) -> None:
        """Release every block of the request, tail first (so the tail is evicted first)."""
        self.pool.req = rid
        self.num_cached.pop(rid, None)
        self.pool.free_blocks(list(reversed(self.blocks.pop(rid, []))))
        self.pool.req = -1

    def holds(self, rid: int) -> bool:
        return rid in self.blocks
