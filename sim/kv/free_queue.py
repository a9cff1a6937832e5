"""The free-block queue: TensorRT-LLM's `LRUEvictionPolicy` (evictionPolicy.cpp).

One LRU queue per retention priority. The front block of the lowest non-empty priority is
taken next; a released block joins the back of its priority's queue, or the front when the
caller says so (a block rewound off a sequence's end, `releaseLastBlock`). Every block starts
in the default priority's queue, in id order. kvsim has no retention configs, so every block
keeps the default priority unless a test sets one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

# executor::KvCacheRetentionConfig::kDefaultRetentionPriority (min 0, max 100)
DEFAULT_PRIORITY = 35


class FreeQueue:
    __slots__ = ("queues", "levels", "priority", "n")

    def __init__(self, blocks: Iterable[int], num_blocks: int) -> None:
        self.queues: dict[int, OrderedDict[int, None]] = {
            DEFAULT_PRIORITY: OrderedDict((b, None) for b in blocks)}
        self.levels = [DEFAULT_PRIORITY]  # sorted: lower priorities are evicted first
        self.priority = [DEFAULT_PRIORITY] * num_blocks
        self.n = len(self.queues[DEFAULT_PRIORITY])

    def __len__(self) -> int:
        return self.n

    def __contains__(self, b: int) -> bool:
        return b in self.queues[self.priority[b]]

    def __iter__(self) -> Iterator[int]:
        """Free blocks in the order they would be taken."""
        for p in self.levels:
            yield from self.queues[p]

    def peek(self) -> int:
        return next(iter(self))

    def pop(self) -> int:
        for p in self.levels:
            q = self.queues[p]
            if q:
                self.n -= 1
                return q.popitem(last=False)[0]
        raise IndexError("pop from an empty free queue")

    def push(self, b: int, front: bool = False) -> None:
        p = self.priority[b]
        q = self.queues.get(p)
        if q is None:
            q = self.queues[p] = OrderedDict()
            self.levels = sorted(self.queues)
        q[b] = None
        if front:
            q.move_to_end(b, last=False)
        self.n += 1

    def remove(self, b: int) -> None:
        del self.queues[self.priority[b]][b]
        self.n -= 1

    def set_priority(self, b: int, priority: int) -> None:
        """A new priority overrides the old one (`claimBlock`); a free block changes queue."""
        was_free = b in self
        if was_free:
            self.remove(b)
        self.priority[b] = priority
        if was_free:
            self.push(b)
