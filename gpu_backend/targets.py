"""The pages a step's appends target, for the page watch (`watch.IncrementalWatch`): which it
checks, and on which a moved checksum blames nobody. One compiled pass (`prepk.targets`) where
the step is long enough to pay its call, else numpy (its oracle, tests/unit/test_prepk.py).
"""

from __future__ import annotations

import numpy as np

from gpu_backend import prepk
from gpu_backend.intsets import ascending, member, unique
from gpu_backend.layout import StepBatch

_NONE = np.zeros(0, dtype=np.int64)


def distinct(pages: np.ndarray) -> np.ndarray:
    """The pages, sorted and distinct."""
    return prepk.distinct(pages) if prepk.takes(len(pages)) else unique(pages)


def targets(b: StepBatch, pages: int, touched: np.ndarray | None
            ) -> tuple[np.ndarray, int, np.ndarray]:
    """(wpages, wcheck, wok): the pages inside the pool that step b's appends target, those
    its events did not touch first, how many of the latter, and per page whether the step may
    write it through every append that does (`_blameless`). touched: the pages the events
    touched, sorted and distinct, or None."""
    if prepk.takes(len(b.engine_write)):
        return prepk.targets(b.engine_write, pages, _NONE if touched is None else touched,
                             touched is not None, b.allowed_pages, b.write_ok)
    w, n = _numpy_targets(b, pages, touched)
    return w, n, _blameless(b, w)


def _numpy_targets(b: StepBatch, pages: int, touched: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(the pages the step's appends target inside the pool, those its events did not touch
    first; how many of the latter). touched: the pages the events touched, sorted, distinct."""
    ew, long = b.engine_write, len(b.engine_write) > 4096
    if long:  # a page's appends come in runs: ~16x fewer values to mask (131k -> 8k)
        ew = prepk.runs(ew)
    w = unique(ew[(ew >= 0) & (ew < pages)], collapse=not long)
    if touched is None:
        return w, len(w)
    hit = member(w, touched)
    return np.concatenate([w[~hit], w[hit]]), int((~hit).sum())


def _blameless(b: StepBatch, wpages: np.ndarray) -> np.ndarray:
    """[len(wpages)] bool: the page is one the step may write (`allowed_pages`) and every append
    that targets it may write it (`write_ok`). A moved checksum on such a page is no row's
    fault (`oracle.blame` finds none), so the usual step needs no blame at all."""
    ok = member(wpages, ascending(b.allowed_pages.astype(np.int64)))
    ew = b.engine_write
    wrong = unique(ew[~b.write_ok])
    return ok & ~member(wpages, wrong) if len(wrong) else ok
