"""Which pool pages a step's kernels changed (docs/design.md §6 "Writes"), two ways with one answer.

`FullWatch` sums every page of the pool after every step and compares: the obvious check, and
on the GPU a third full read of the KV bytes per step beside FlashInfer's and the reference's
(the device is then busy ~2.9-3.0x the kernels' own time).

`IncrementalWatch` reads, per step, only the pages the step's appends target (`wpages`: the
engine's table, known ahead) and keeps an *expected* sum for every page:
  - after the block events, the pages they touched are re-summed (both watches do this), and
    the target pages are summed (`pre`); a target's sum that differs from its expected value
    (the events did not touch it) means something changed that page unseen: stale;
  - after the kernels, the targets are summed again: changed = after != pre, expected = after;
    and the pages the next step's events will touch are checked against their expected sums
    before those events overwrite them (their content would hide an earlier change);
  - every `every` steps, and after the last, the whole pool is summed once and compared with the
    expected sums: any page changed where no append was aimed shows there.
So a page changed outside the targets is never absorbed into an expected sum unchecked. If the
replay ends with nothing stale, each step's changed pages are exactly FullWatch's (outside the
targets nothing changed; on them the same before/after sums); if anything was stale, the driver
replays the trace again with FullWatch, whose per-step answer the verdicts then use. One extra
full pass per `every` steps instead of one per step; the re-run costs only when a kernel wrote
where the engine's metadata did not aim it, which FullWatch then attributes to its step.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_backend.device.pool import KVPool
from gpu_backend.host.prepare import Prepared

EVERY = 16  # steps between IncrementalWatch's whole-pool checks


class Unseen(Exception):
    """IncrementalWatch found a page changed where no append aimed: replay with FullWatch."""


class FullWatch:
    name = "full"

    def __init__(self, pool: KVPool, fresh: bool = False):
        self.pool = pool
        # every page's sum as of the last look; fresh: nothing has written the pool since it
        # was made, so they are known without one (`KVPool.fresh_checksum`)
        self.sums = pool.fresh_checksum() if fresh else pool.checksum()
        self.fresh = fresh

    def before_events(self, p: Prepared) -> None:
        pass

    def after_events(self, p: Prepared) -> None:
        # only the touched pages' sums moved since the last step's checksum (on a fresh pool
        # with no op, none: `written`)
        if written(self, p) and p.touched:
            self.pool.resum(self.sums, p.dv["touched"])

    def after_kernels(self, p: Prepared, nxt: Prepared | None, last: bool) -> torch.Tensor:
        """The step's moved pages, on the device: [pages] bool."""
        self.sums, changed = self.pool.sums_and_changes(self.sums)
        return changed

    def on_fault(self) -> None:
        """The step did not run to the end: take the pool as it is."""
        self.sums = self.pool.checksum()

    def stale(self) -> torch.Tensor | None:
        return None

    def changed_pages(self, p: Prepared, moved: np.ndarray) -> np.ndarray:
        return moved


class IncrementalWatch:
    name = "incremental"

    def __init__(self, pool: KVPool, fresh: bool = False, every: int = EVERY):
        self.pool, self.every, self.n = pool, every, 0
        # expected sums; fresh: nothing has written the pool since it was made, so they are
        # known without a look (`KVPool.fresh_checksum`), and so is the first step's (`written`)
        self.sums = pool.fresh_checksum() if fresh else pool.checksum()
        self.fresh = fresh
        self.pre = torch.zeros_like(self.sums)  # the targets' sums before the step's kernels
        # step stamp of the last step whose targets included the page (-1: none yet)
        self.stamp = torch.full_like(self.sums, -1)
        self.flag = torch.zeros(1, dtype=torch.int32, device=self.sums.device)  # stale if != 0
        # the step a CUDA graph ran last, whose look at the next events' pages is still owed
        # (`graphs`: a graph step's own graph does it for the step before)
        self.owed: int | None = None

    def before_events(self, p: Prepared) -> None:
        """An eager step after a graph step: that step's check of the pages these events touch,
        before they do."""
        if self.owed is not None and p.touched:
            self.pool.post_check(None, p.dv["touched"], self.sums, self.pre, self.stamp,
                                 self.flag, self.owed)
        self.owed = None

    def after_events(self, p: Prepared) -> None:
        """The touched pages re-summed (checked before the events ran: after_kernels of the
        step before), the targets summed and checked: one launch on the GPU. On a pool nothing
        has written (`written`), every sum is the one expected: the targets' are copied."""
        idx = p.dv["wpages"] if len(p.wpages) else None
        if not written(self, p):
            if idx is not None:
                self.pre.copy_(self.sums)
                self.stamp.index_fill_(0, idx, p.b.step)
            return
        self.pool.resum_pre(p.dv["touched"] if p.touched else None, idx, p.wcheck, self.sums,
                            self.pre, self.stamp, self.flag, p.b.step)

    def after_kernels(self, p: Prepared, nxt: Prepared | None, last: bool) -> torch.Tensor:
        """The targets' moved flags, on the device: [len(p.wpages)] bool."""
        ahead = nxt.dv["touched"] if nxt is not None and nxt.touched else None
        changed = self.pool.post_check(p.dv["wpages"] if len(p.wpages) else None, ahead,
                                       self.sums, self.pre, self.stamp, self.flag, p.b.step)
        self._count(last)
        return changed

    def after_graph(self, p: Prepared, last: bool) -> None:
        """A step whose graph ran the events and the checks (`graphs`): the whole-pool check
        when due; the next events' pages are the next step's to check."""
        self.owed, self.fresh = p.b.step, False
        self._count(last)

    def _count(self, last: bool) -> None:
        self.n += 1
        if last or self.n % self.every == 0:
            self.pool.full_check(self.sums, self.flag)

    def on_fault(self) -> None:
        raise Unseen("a step faulted: its partial writes are attributed by the full watch")

    def stale(self) -> torch.Tensor | None:
        return self.flag

    def changed_pages(self, p: Prepared, moved: np.ndarray) -> np.ndarray:
        out = np.zeros(self.pool.total, dtype=bool)
        out[p.wpages] = moved
        return out


Watch = FullWatch | IncrementalWatch


def written(w: Watch, p: Prepared) -> bool:
    """Whether the pool may hold other bits than the watch's sums say, after step p's events:
    False only on the first step of a pool nothing has written since it was made (`fresh`)
    whose events apply no op (a fresh pool's new pages need no poison: `events.fresh_pool`).
    Its touched pages and targets then still sum to the made pool's sums, and a look at them
    read ~1 GB at a 64 x 2k prompts' step (0.27 ms of device). Nothing but
    the pool's own fill ran on it before, so nothing there is left unseen; the step's kernels
    run after this and are checked as every step's are. Asking ends the freshness: a watch asks
    once a step, after its events, and the kernels write next."""
    fresh, w.fresh = w.fresh, False
    return not fresh or bool(p.ops)
