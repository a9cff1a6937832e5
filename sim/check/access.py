"""The kernels' page access model (docs/design.md §3.5), shared by the checker and CPU replay.

Given one step's engine metadata, it says exactly which (position, page, slot) each row's
attention READS and which its `append_paged_kv_cache` WRITES, as FlashInfer 0.7.2 would:

    CSR (fa2/fa3):  kv_indices = pages[row 0] ++ pages[row 1] ++ ...   (the flat array)
                    position p of row r -> ordinal kv_indptr[r] + p // B -> page, slot p % B
    block table (xqa): position p of row r -> pages[r][p // B]          (the table row)

Nothing in the kernels bounds-checks, so an ordinal outside the row is followed, not refused:
the flags below say how each access went wrong. Everything is vectorized over the whole step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from sim.trace.records import RowRecord

OUTSIDE_ROW = 1  # ordinal outside the row's own [kv_indptr, kv_indptr + nb) / column >= width
CLAMPED = 2  # fa2: ordinal past the global end: protective_get_kv_offset returns offset 0
WILD = 4  # ordinal outside the flat array (fa3, append) or past the table row (xqa): page -1
INVALID = 8  # page id outside [0, num_blocks), -1 included

CSR_BACKENDS = ("fa2", "fa3")


@dataclass(frozen=True, slots=True)
class Layout:
    """One step's metadata, flattened. All arrays int64; rows in batch order.

    pages[pages_ptr[r]:pages_ptr[r+1]] is row r's `pages`; append_pos likewise with append_ptr.
    """

    pages: np.ndarray
    pages_ptr: np.ndarray  # [rows+1]
    kv_indptr: np.ndarray  # [rows]
    last_page_len: np.ndarray  # [rows]
    kv_len: np.ndarray  # [rows] host length passed to the kernel (fa3/xqa)
    append_pos: np.ndarray
    append_ptr: np.ndarray  # [rows+1]

    @classmethod
    def from_rows(cls, rows: Sequence[RowRecord]) -> Layout:
        n = len(rows)
        return cls(
            pages=flatten(r.pages for r in rows),
            pages_ptr=offsets(len(r.pages) for r in rows),
            kv_indptr=np.fromiter((r.kv_indptr for r in rows), np.int64, n),
            last_page_len=np.fromiter((r.last_page_len for r in rows), np.int64, n),
            kv_len=np.fromiter((r.kv_len for r in rows), np.int64, n),
            append_pos=flatten(r.append_pos for r in rows),
            append_ptr=offsets(len(r.append_pos) for r in rows),
        )


@dataclass(frozen=True, slots=True)
class Accesses:
    """One entry per (row, position) access; accesses of row r are [ptr[r], ptr[r+1])."""

    ptr: np.ndarray
    row: np.ndarray
    pos: np.ndarray
    page: np.ndarray  # -1 for a wild access
    slot: np.ndarray
    ordinal: np.ndarray  # flat kv_indices ordinal (CSR) or block-table column (xqa)
    flags: np.ndarray  # OUTSIDE_ROW | CLAMPED | WILD | INVALID

    def of_row(self, r: int) -> list[tuple[int, int, int]]:
        """(position, page, slot) of row r's accesses, in position order."""
        s = slice(int(self.ptr[r]), int(self.ptr[r + 1]))
        return list(zip(self.pos[s].tolist(), self.page[s].tolist(), self.slot[s].tolist(),
                        strict=True))

    def flagged(self, r: int, flag: int) -> list[tuple[int, int, int]]:
        s = slice(int(self.ptr[r]), int(self.ptr[r + 1]))
        hit = (self.flags[s] & flag) != 0
        return list(zip(self.pos[s][hit].tolist(), self.page[s][hit].tolist(),
                        self.slot[s][hit].tolist(), strict=True))


@dataclass(frozen=True, slots=True)
class Chunks:
    """Reads grouped per (row, page column): positions [first, first + count) of one page.

    Every access of a chunk goes through the same ordinal and page, so checks that only need
    the page (and slot ranges) run per chunk instead of per slot.
    """

    row: np.ndarray
    col: np.ndarray  # p // B, the row-relative page index
    first: np.ndarray
    count: np.ndarray
    page: np.ndarray
    ordinal: np.ndarray
    flags: np.ndarray

    def expand(self, block: int, rows: int) -> Accesses:
        """The per-slot accesses (position order within each row)."""
        row, off = _expand(self.count)
        chunk = np.repeat(np.arange(len(self.count)), self.count)
        pos = self.first[chunk] + off
        flags = self.flags[chunk]
        slot = np.where((flags & CLAMPED) != 0, 0, pos % block)
        row = self.row[chunk]
        ptr = np.searchsorted(row, np.arange(rows + 1))
        return Accesses(ptr, row, pos, self.page[chunk], slot, self.ordinal[chunk], flags)


class StepAccess:
    """A step's accesses: `reads` (union over the causal mask: query j sees positions
    [0, kv_len - q_len + j]) and `writes` (the append of the rows' new K/V)."""

    __slots__ = ("kernel_len", "read_chunks", "writes", "_reads", "_block")

    def __init__(self, kernel_len: np.ndarray, read_chunks: Chunks, writes: Accesses,
                 block: int) -> None:
        self.kernel_len = kernel_len  # [rows] kv length the attention kernel covers
        self.read_chunks = read_chunks
        self.writes = writes
        self._reads: Accesses | None = None
        self._block = block

    @property
    def reads(self) -> Accesses:
        if self._reads is None:  # built on demand: the checker works on chunks
            self._reads = self.read_chunks.expand(self._block, len(self.kernel_len))
        return self._reads


def step_access(backend: str, rows: Sequence[RowRecord], block: int,
                num_blocks: int) -> StepAccess:
    """Access model of one step from its rows (see `access_of` for the semantics)."""
    return access_of(backend, Layout.from_rows(rows), block, num_blocks)


def access_of(backend: str, lay: Layout, block: int, num_blocks: int) -> StepAccess:
    """Reads and writes of a step under `backend` ("fa2" | "fa3" | "xqa"), B = `block`."""
    kernel_len = _kernel_len(backend, lay, block)
    row, col = _expand(-(-kernel_len // block))
    first = col * block
    count = np.minimum(kernel_len[row] - first, block)
    page, ordinal, flags = _page_of(backend, lay, num_blocks, row, col, clamp=backend == "fa2")
    chunks = Chunks(row, col, first, count, page, ordinal, flags)
    wrow = np.repeat(np.arange(len(lay.kv_indptr)), np.diff(lay.append_ptr))
    pos = lay.append_pos
    page, ordinal, flags = _page_of(backend, lay, num_blocks, wrow, pos // block, clamp=False)
    ptr = np.searchsorted(wrow, np.arange(len(lay.kv_indptr) + 1))
    writes = Accesses(ptr, wrow, pos, page, pos % block, ordinal, flags)
    return StepAccess(kernel_len, chunks, writes, block)


def _kernel_len(backend: str, lay: Layout, block: int) -> np.ndarray:
    if backend == "fa2":
        # the device recomputes the length from the pages: (nb - 1) * B + last_page_len
        nb = np.diff(lay.pages_ptr)
        derived = np.where(nb > 0, (nb - 1) * block + lay.last_page_len, 0)
        return np.maximum(derived, 0)
    return np.maximum(lay.kv_len, 0)


def _page_of(backend: str, lay: Layout, num_blocks: int, row: np.ndarray, col: np.ndarray,
             clamp: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Page, ordinal and flags of page column `col` of each `row` (no bounds checks)."""
    nb = np.diff(lay.pages_ptr)[row]
    csr = backend in CSR_BACKENDS
    lo = lay.kv_indptr[row] if csr else np.zeros_like(col)
    ordinal = lo + col
    outside = (ordinal < lo) | (ordinal >= lo + nb)
    flat = ordinal if csr else lay.pages_ptr[row] + col
    inside = (flat >= 0) & (flat < len(lay.pages))
    if not csr:
        inside &= ~outside  # a block-table row is read only through its own columns
    page = lay.pages[np.clip(flat, 0, len(lay.pages) - 1)] if len(lay.pages) else flat
    page = np.where(inside, page, -1)
    flags = np.where(outside, OUTSIDE_ROW, 0)
    if clamp:
        # FA2 guards only the global end (ordinal >= indptr[-1]): it reads element offset 0
        past = ordinal >= len(lay.pages)
        page = np.where(past, 0, page)
        flags |= np.where(past, CLAMPED, 0)
        inside |= past
    flags |= np.where(inside, 0, WILD)
    flags |= np.where((page < 0) | (page >= num_blocks), INVALID, 0)
    return page, ordinal, flags


def _expand(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row index and offset 0..len-1 of every element of a ragged range."""
    total = int(lengths.sum())
    row = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    return row, np.arange(total, dtype=np.int64) - starts[row]


def flatten(seqs: Iterable[Iterable[int]]) -> np.ndarray:
    return np.fromiter(chain.from_iterable(seqs), np.int64)


def offsets(lengths: Iterable[int]) -> np.ndarray:
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(np.fromiter(lengths, np.int64))])
