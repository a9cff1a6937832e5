"""Where the KV mechanisms append their block events (docs/design.md §3.7 Pool, docs/trace.md)."""

from __future__ import annotations

from sim.trace.records import BlockEvent


class EventLog:
    """Append-only block-event sink; the engine moves `step`/`phase` as the iteration advances."""

    __slots__ = ("events", "step", "phase", "seq", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.events: list[BlockEvent] = []
        self.step = 0
        self.phase = "sched"
        self.seq = 0
        self.enabled = enabled

    def emit(self, event: str, block: int, request: int, refcount: int, src: int = -1,
             num_tokens: int = 0, hash_: int = 0) -> None:
        if self.enabled:
            self.events.append(BlockEvent(self.step, self.phase, self.seq, event, block, request,
                                          refcount, src, num_tokens, hash_))
        self.seq += 1

    def drain(self) -> list[BlockEvent]:
        out, self.events = self.events, []
        return out
