"""The replay loop's prepared steps (`driver._loop`), some pulled ahead while the host would
otherwise wait for the device."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from gpu_backend.prepare import Prepared

BANK_WORDS = 1 << 25  # int64 words of the banked steps' chunks, at most (256 MiB pinned, as
# much on the device), besides the bank's steps (`driver.BANK`)


class Ahead:
    """The prepared steps in order, some pulled ahead of the loop (at most `bank`) while the
    host would otherwise wait for the device (`fill`)."""

    def __init__(self, steps: Iterator[Prepared], bank: int):
        self.steps, self.bank = steps, bank
        self.banked: deque[Prepared] = deque()
        self.pulled = 0  # steps prepared ahead in all
        self.words = 0  # of the chunks that banked steps came in since the bank was last empty
        self.chunk: object = None

    def next(self) -> Prepared | None:
        if not self.banked:
            self.words = 0
            return next(self.steps, None)
        return self.banked.popleft()

    def fill(self, busy: torch.cuda.Event | None) -> None:
        """Prepare steps until the device has done the work before `busy` (None: no device
        work to wait for) or the bank is full. Past the event by one step's preparation at
        most."""
        while busy is not None and len(self.banked) < self.bank and \
                self.words < BANK_WORDS and not busy.query():
            p = next(self.steps, None)
            if p is None:
                return
            self.banked.append(p)
            self.pulled += 1
            if p.dv.chunk is not self.chunk:
                self.chunk, self.words = p.dv.chunk, self.words + p.dv.chunk.n
