"""I10, the slot-content model: what each (page, slot) holds, and whether attention may read it.

Per slot (flattened as page * B + slot) we track a state and, once written, its writer:

    UNWRITTEN  never written, or a previous owner's data after a fresh `alloc` of the block
    WRITTEN    K/V of token `pos` of request `owner`
    REJECTED   a draft the target did not accept (set right after the step's reads)

Within a step the device appends every row's new K/V, then attends, then the step's rejected
drafts stop being valid: that is the order `launch` applies. `reuse` keeps content; `copy`
copies the first num_tokens slots' states from `src`.
"""

from __future__ import annotations

import numpy as np

from sim.check.access import CLAMPED, INVALID, Chunks
from sim.check.view import Model, StepView, first_in_row, row_violations
from sim.trace.records import BlockEvent, Violation

UNWRITTEN, WRITTEN, REJECTED = 0, 1, 2


class SlotModel:
    def __init__(self, m: Model) -> None:
        self.B = m.B
        n = m.num_blocks * m.B
        self.state = np.zeros(n, np.int8)
        self.owner = np.full(n, -1, np.int64)
        self.pos = np.full(n, -1, np.int64)

    def event(self, ev: BlockEvent) -> None:
        B, b = self.B, ev.block
        if not 0 <= b < len(self.state) // B:
            return  # reported by POOL
        if ev.event == "alloc":
            self.state[b * B:(b + 1) * B] = UNWRITTEN
        elif ev.event == "copy" and 0 <= ev.src < len(self.state) // B:
            n = min(ev.num_tokens, B)
            for arr in (self.state, self.owner, self.pos):
                arr[b * B:b * B + n] = arr[ev.src * B:ev.src * B + n]

    def launch(self, v: StepView) -> list[Violation]:
        """Apply the step's appends, check its reads, then retire its rejected drafts."""
        w = v.acc.writes
        ok = (w.flags & INVALID) == 0
        idx = (w.page * self.B + w.slot)[ok]
        j = np.arange(len(w.row)) - w.ptr[w.row]
        truth = v.col["committed"][w.row] + j  # the token written is the j-th new one
        self.state[idx] = WRITTEN
        self.owner[idx] = v.col["request"][w.row][ok]
        self.pos[idx] = truth[ok]
        out = self._check_reads(v)
        acc = v.col["accepted"][w.row]
        drop = ok & v.is_gen[w.row] & (acc >= 0) & (j > acc)
        self.state[(w.page * self.B + w.slot)[drop]] = REJECTED
        return out

    def _check_reads(self, v: StepView) -> list[Violation]:
        """Per read chunk (one page, up to B consecutive positions), as a (chunks, B) grid."""
        c, B = v.acc.read_chunks, self.B
        has = c.col < v.n_alloc[c.row]
        want = np.full(len(c.col), -2, np.int64)
        want[has] = v.alloc[v.alloc_ptr[c.row[has]] + c.col[has]]
        page_ok = ((c.flags & (INVALID | CLAMPED)) == 0) & (c.page == want)
        base = np.where(page_ok, c.page, 0)[:, None] * B + np.arange(B)
        expect = c.first[:, None] + np.arange(B)
        good = (self.state[base] == WRITTEN) & (self.pos[base] == expect)
        # this step's own new tokens must be this request's, not another row's stray append
        new = np.flatnonzero(c.first + c.count > v.col["committed"][c.row])
        mine = self.owner[base[new]] == v.col["request"][c.row[new], None]
        good[new] &= mine | (expect[new] < v.col["committed"][c.row[new], None])
        bad = ~good & (np.arange(B) < c.count[:, None]) & page_ok[:, None]
        n_bad = np.where(page_ok, bad.sum(1), c.count)
        first = first_in_row(n_bad > 0, c.row, v.n)
        counts = np.bincount(c.row, weights=n_bad, minlength=v.n).astype(np.int64)
        return row_violations("I10", v, first >= 0, lambda r: self._first_bad(
            c, int(first[r]), bad, page_ok, int(want[first[r]]), int(counts[r]) - 1))

    def _first_bad(self, c: Chunks, i: int, bad: np.ndarray, page_ok: np.ndarray, want: int,
                   more: int) -> str:
        s = int(np.argmax(bad[i])) if page_ok[i] else 0
        slot = 0 if c.flags[i] & CLAMPED else (int(c.first[i]) + s) % self.B
        return self._describe(int(c.first[i]) + s, int(c.page[i]), slot, want, more)

    def _describe(self, p: int, page: int, slot: int, want: int, more: int) -> str:
        where = f"attention reads position {p} through page {page} slot {slot}"
        exp = f"expected page {want}" if want >= 0 else "beyond the request's allocated blocks"
        tail = f" (and {more} more bad slots)" if more else ""
        if not 0 <= page * self.B + slot < len(self.state) or page < 0:
            return f"{where} ({exp}), an invalid page{tail}"
        i = page * self.B + slot
        held = {UNWRITTEN: "never written since alloc",
                WRITTEN: f"req {self.owner[i]} position {self.pos[i]}",
                REJECTED: f"a rejected draft of req {self.owner[i]} position {self.pos[i]}"}
        return f"{where} ({exp}), which holds {held[int(self.state[i])]}{tail}"
