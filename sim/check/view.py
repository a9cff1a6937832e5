"""One launched step's rows as numpy columns, built once and shared by every invariant module."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from sim.check.access import Layout, StepAccess, access_of, flatten, offsets
from sim.trace.records import RowRecord, StepRecord, Violation

_SCALARS = ("request", "q_len", "committed", "reserved", "kv_len", "kv_len_host", "cached_host",
            "last_page_len", "kv_indptr", "shared_blocks", "accepted", "max_pos",
            "prev_new_tokens", "first_gen", "prev_in_flight")
_get = attrgetter(*_SCALARS)


@dataclass(frozen=True, slots=True)
class Model:
    """The manifest's "model" dict, the parts the checks use."""

    B: int
    num_blocks: int
    null_block: bool
    plan_cache_limit: int = 64

    @classmethod
    def from_dict(cls, model: dict) -> Model:
        # A plan per query width (1..D+1) and one for prefill; more means the key grows with
        # something else (the batch size, TRT-LLM #18557).
        limit = int(model.get("max_draft_len", 62)) + 2
        return cls(int(model["tokens_per_block"]), int(model["num_blocks"]),
                   bool(model.get("null_block", False)), limit)


class StepView:
    """Columns of one step: `col[name][r]` for the scalar fields, ragged lists flattened."""

    __slots__ = ("step", "rows", "n", "backend", "lay", "acc", "col", "is_gen", "alloc",
                 "alloc_ptr", "n_alloc", "nb", "rope_pos", "rope_ptr")

    def __init__(self, step: StepRecord, rows: Sequence[RowRecord], model: Model) -> None:
        self.step, self.rows, self.n, self.backend = step, rows, len(rows), step.backend
        table = np.array([_get(r) for r in rows], np.int64).reshape(len(rows), len(_SCALARS))
        self.col = {name: table[:, i] for i, name in enumerate(_SCALARS)}
        self.is_gen = np.fromiter((r.phase == "gen" for r in rows), bool, len(rows))
        self.lay = Layout.from_rows(rows)
        self.nb = np.diff(self.lay.pages_ptr)
        self.alloc = flatten(r.alloc for r in rows)
        self.alloc_ptr = offsets(len(r.alloc) for r in rows)
        self.n_alloc = np.diff(self.alloc_ptr)
        self.rope_pos = flatten(r.rope_pos for r in rows)
        self.rope_ptr = offsets(len(r.rope_pos) for r in rows)
        self.acc: StepAccess = access_of(step.backend, self.lay, model.B, model.num_blocks)

    def req(self, r: int) -> int:
        return int(self.col["request"][r])

    def alloc_of(self, r: int) -> list[int]:
        return self.alloc[self.alloc_ptr[r]:self.alloc_ptr[r + 1]].tolist()


def violation(inv: str, step: int, request: int, text: str) -> Violation:
    """A violation whose message names the invariant, step and request first."""
    where = f"step {step} req {request}" if request >= 0 else f"step {step}"
    return Violation(inv, step, request, f"{inv} {where}: {text}")


def row_violations(inv: str, view: StepView, bad: np.ndarray,
                   text: Callable[[int], str]) -> list[Violation]:
    """One violation per row flagged in `bad`, worded by text(r) (only bad rows pay for it)."""
    return [violation(inv, view.step.step, view.req(r), text(r))
            for r in np.flatnonzero(bad).tolist()]


def ceil_div(a: np.ndarray | int, b: int) -> np.ndarray:
    return -(-np.asarray(a) // b)


def seg_max(values: np.ndarray, ptr: np.ndarray, empty: int = -1) -> np.ndarray:
    """Per-segment max of a ragged array (segments [ptr[i], ptr[i+1])); `empty` where none."""
    out = np.full(len(ptr) - 1, empty, np.int64)
    has = np.diff(ptr) > 0
    if has.any():
        out[has] = np.maximum.reduceat(values, ptr[:-1][has])
    return out


def first_in_row(mask: np.ndarray, row: np.ndarray, n: int) -> np.ndarray:
    """Index of the first True of `mask` per row (-1 where none); `row` is sorted."""
    idx = np.flatnonzero(mask)
    out = np.full(n, -1, np.int64)
    rows, first = np.unique(row[idx], return_index=True)
    out[rows] = idx[first]
    return out
