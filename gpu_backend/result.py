"""A replay's verdicts: per-row codes and errors kept as arrays, rows as objects on demand.

The loop judges a read-back's steps (`driver.EARLY` of them) in one numpy pass over all their
tokens (`judge`) and keeps the codes as arrays (`Judged`): building a `RowResult` per row inside
the loop was ~85 µs of its host a step at batch 64 on the H200, a sixth
of a step's wall. `ReplayResult.rows` builds the objects the first time it is read; `counts`,
`ok` and `max_ok_error` read the arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu_backend.oracle import FAULT, OK, VERDICTS
from sim.trace.records import RowRecord


@dataclass
class RowResult:
    step: int
    row: int
    request: int
    phase: str
    q_len: int
    verdict: str
    err: float
    message: str = ""


@dataclass
class Judged:
    """The verdicts of some consecutive steps: their rows' codes (`oracle` OK..FAULT) and max
    errors end to end, and the message of each step that faulted (by its index in `rows`)."""
    rows: list[list[RowRecord]]
    code: np.ndarray  # [rows] int
    err: np.ndarray  # [rows] float32 (NaN where the step faulted)
    faults: dict[int, str] = field(default_factory=dict)

    def results(self) -> list[RowResult]:
        out: list[RowResult] = []
        at = 0
        for i, rows in enumerate(self.rows):
            n = len(rows)
            msg = self.faults.get(i, "")
            for r, c, e in zip(rows, self.code[at: at + n].tolist(),
                               self.err[at: at + n].tolist(), strict=True):
                out.append(RowResult(r.step, r.row, r.request, r.phase, r.q_len, VERDICTS[c],
                                     float(e), msg if c == FAULT else ""))
            at += n
        return out


@dataclass
class ReplayResult:
    backend: str
    trace: str
    tol: float
    # what the kernels measured beside the rows (FlashInfer: the plan cache's memory)
    stats: dict[str, Any] = field(default_factory=dict)
    prepare_s: float = 0.0  # host seconds spent in `prepare` (not serialized: timing noise)
    prepare_step_s: dict[int, float] = field(default_factory=dict)  # step -> its share of it
    watch: str = ""  # how page changes were found (`replay`'s watch)
    judged: list[Judged] = field(default_factory=list, repr=False)  # in step order
    _rows: list[RowResult] = field(default_factory=list, repr=False)
    _built: int = field(default=0, repr=False)  # judged entries already in _rows

    @property
    def rows(self) -> list[RowResult]:
        """Every row's verdict in step and row order (built from `judged` on first read)."""
        for j in self.judged[self._built:]:
            self._rows += j.results()
        self._built = len(self.judged)
        return self._rows

    @rows.setter
    def rows(self, rows: list[RowResult]) -> None:  # a result read back from JSON
        self._rows, self.judged, self._built = list(rows), [], 0

    def codes(self) -> np.ndarray:
        """Every row's verdict code (`oracle.VERDICTS` index), in row order."""
        if not self.judged:
            return np.array([VERDICTS.index(r.verdict) for r in self._rows], dtype=np.int64)
        return np.concatenate([j.code for j in self.judged]).astype(np.int64, copy=False)

    def errors(self) -> np.ndarray:
        if not self.judged:
            return np.array([r.err for r in self._rows], dtype=np.float64)
        return np.concatenate([j.err for j in self.judged]).astype(np.float64)

    def counts(self) -> dict[str, int]:
        n = np.bincount(self.codes(), minlength=len(VERDICTS))
        return {v: int(n[i]) for i, v in enumerate(VERDICTS)}

    @property
    def ok(self) -> bool:
        return bool((self.codes() == OK).all())


def max_ok_error(res: ReplayResult) -> float:
    ok = res.codes() == OK
    return float(res.errors()[ok].max()) if ok.any() else 0.0
