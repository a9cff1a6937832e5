"""Token content for generated prompts, made lazily so a million-request workload stays small.

A workload is first planned as a few numpy arrays (one value per request); token ids are only
made while iterating. Each request reads the first `prompt_len` tokens of its *unit*'s stream:
a unit is one request, or one whole chat session (each turn's prompt is a prefix of the
session's stream, so turn t really contains turn t-1's prompt). Streams are generated a chunk of
consecutive units at a time, each chunk from its own generator seeded with
(content_seed, chunk ordinal), and dropped once every request reading it has been yielded: the
content does not depend on who reads what first.

    stream of unit u:  [ shared prefix (group g, min(L, len)) | random ids ........ ]
    request reading u: [ prompt_len tokens ]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from sim.workload.spec import RequestSpec

CHUNK_UNITS = 4096  # a chunk ends at whichever bound comes first
CHUNK_TOKENS = 1 << 22  # ~16 MiB of int32 per chunk
_BATCH = 8192  # requests converted from numpy to Python ints at a time


@dataclass(frozen=True, slots=True)
class Plan:
    """Per-request scalars in arrival order, and what token content derives from.

    All arrays are int64; [n] per request, [u] per unit.
    """

    arrival_ns: np.ndarray  # [n] non-decreasing
    prompt_len: np.ndarray  # [n] >= 1
    output_len: np.ndarray  # [n] >= 1
    unit: np.ndarray  # [n] the unit whose stream the prompt is a prefix of
    session: np.ndarray  # [n] -1 outside sessions
    unit_len: np.ndarray  # [u] stream length: the longest prompt reading it
    unit_group: np.ndarray  # [u] shared-prefix group, -1 for none
    prefixes: np.ndarray  # int32 [groups, prefix_len]
    content_seed: int
    vocab_size: int


def chunk_bounds(unit_len: np.ndarray) -> np.ndarray:
    """Start unit of every chunk, plus the end: chunk k holds units [b[k], b[k+1])."""
    before = np.cumsum(unit_len) - unit_len
    # Both terms are non-decreasing in u, so equal keys form consecutive runs (the chunks).
    key = before // CHUNK_TOKENS + np.arange(len(unit_len)) // CHUNK_UNITS
    starts = np.flatnonzero(np.diff(key, prepend=-1))
    return np.append(starts, len(unit_len))


class _Streams:
    """Unit streams by chunk, kept only while some request still has to read them."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._bounds = chunk_bounds(plan.unit_len)
        units = len(plan.unit_len)
        self.chunk_of = np.searchsorted(self._bounds, np.arange(units), side="right") - 1
        # offset of unit u's stream inside its chunk's buffer
        before = np.cumsum(plan.unit_len) - plan.unit_len
        self.offset_of = before - before[self._bounds[:-1]][self.chunk_of]
        reads = np.bincount(self.chunk_of[plan.unit], minlength=len(self._bounds) - 1)
        self._reads_left: list[int] = reads.tolist()
        self._chunks: dict[int, np.ndarray] = {}

    def take(self, c: int) -> np.ndarray:
        """Chunk c's buffer, for one read; dropped after its last read."""
        buf = self._chunks.get(c)
        if buf is None:
            buf = self._chunks[c] = self._make(c)
        self._reads_left[c] -= 1
        if self._reads_left[c] == 0:
            del self._chunks[c]
        return buf

    def _make(self, c: int) -> np.ndarray:
        p = self._plan
        lo, hi = int(self._bounds[c]), int(self._bounds[c + 1])
        lens = p.unit_len[lo:hi]
        offsets = np.concatenate([[0], np.cumsum(lens)]).tolist()
        # SFC64: ~3x faster than PCG64 here, and token ids need no more than a good mix.
        gen = np.random.Generator(np.random.SFC64(np.random.SeedSequence([p.content_seed, c])))
        buf = gen.integers(0, p.vocab_size, size=offsets[-1], dtype=np.int32)
        groups = p.unit_group[lo:hi]
        for i in np.flatnonzero(groups >= 0).tolist():
            m = min(p.prefixes.shape[1], int(lens[i]))
            buf[offsets[i]:offsets[i] + m] = p.prefixes[groups[i], :m]
        buf.flags.writeable = False  # prompts are views into it
        return buf


def iter_plan(plan: Plan) -> Iterator[RequestSpec]:
    """Yield the planned requests in arrival order, making token content as it goes."""
    streams = _Streams(plan)
    n = len(plan.arrival_ns)
    for lo in range(0, n, _BATCH):
        hi = min(n, lo + _BATCH)
        units = plan.unit[lo:hi]
        start = streams.offset_of[units]
        cols = (plan.arrival_ns[lo:hi], streams.chunk_of[units], start,
                start + plan.prompt_len[lo:hi], plan.output_len[lo:hi], plan.session[lo:hi])
        rows = zip(*(col.tolist() for col in cols), strict=True)
        for rid, (t, c, a, b, o, s) in enumerate(rows, start=lo):
            yield RequestSpec(rid, t, streams.take(c)[a:b], o, s)
