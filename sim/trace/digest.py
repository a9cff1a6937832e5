"""The trace's content digest, computed as the tables stream (writer) or read back (reader).

Two hashes per column (values, lengths), fed value by value in a canonical encoding, so the
digest depends on column names, types and values only — not on record-batch boundaries, Parquet
chunking or file metadata — and the writer never has to read its own trace back to compute it.

The per-column hash depends on the trace's format_version (`HASHERS`): format 3 uses xxh3-128
(xxhash), formats 1 and 2 sha256, so their traces still verify. The digest only has to catch
accidental differences (fast vs reference engine, golden traces, corruption), not an adversary,
and the columns are large: a traced run of 10,000 requests hashes ~1.4 GB, ~0.8 CPU-s of the
writer thread with sha256 (1.7 GB/s here), against 17 GB/s for xxh3-128. The canonical bytes
are the same in every format, and so is the step that combines the per-column hashes (sha256
over a few hundred bytes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import numpy as np
import pyarrow as pa
import xxhash

from sim.trace.records import READABLE_VERSIONS


class _Hash(Protocol):
    def update(self, data: memoryview, /) -> None: ...

    def digest(self) -> bytes: ...


# format_version -> the per-column hash (both release the GIL on large inputs: the writer thread
# hashes beside the simulation)
HASHERS: dict[int, Callable[[], _Hash]] = {1: hashlib.sha256, 2: hashlib.sha256,
                                           3: xxhash.xxh3_128}
assert tuple(HASHERS) == READABLE_VERSIONS, "a readable format_version without its hash"


class TableDigest:
    def __init__(self, name: str, schema: pa.Schema, version: int) -> None:
        """`version`: the format_version whose hash to use (HASHERS)."""
        self.name, self.schema = name, schema
        new = HASHERS[version]
        self.h = {f.name: (new(), new()) for f in schema}

    def update(self, batch: pa.RecordBatch | pa.Table) -> None:
        for f in self.schema:
            col = batch.column(f.name)
            # chunk by chunk: the hash of the concatenation, without concatenating (a trace's
            # page lists are ~1 GB per 10k requests)
            for arr in col.chunks if isinstance(col, pa.ChunkedArray) else [col]:
                if len(arr):  # an empty chunk hashes no bytes (and may have no buffers)
                    self._update(f, arr)

    def _update(self, f: pa.Field, col: pa.Array) -> None:
        values, lengths = self.h[f.name]
        if pa.types.is_list(f.type) or pa.types.is_string(f.type):
            # lengths from the offsets, values straight from Arrow's buffers (no copies)
            off = np.frombuffer(col.buffers()[1], np.int32)
            off = off[col.offset:col.offset + len(col) + 1]
            lengths.update(np.diff(off).astype(np.int32).data)
            if pa.types.is_list(f.type):
                child = col.values
                buf = np.frombuffer(child.buffers()[1], np.int32)[child.offset:]
                values.update(buf[off[0]:off[-1]].data)  # a view: no copy
            elif len(col) and col.buffers()[2] is not None:
                values.update(memoryview(col.buffers()[2])[off[0]:off[-1]])
        elif pa.types.is_boolean(f.type):
            # one byte 0/1 per value, from Arrow's bit buffer (to_numpy imports pandas: ~0.15 s
            # of a traced run's start-up)
            bits = np.unpackbits(np.frombuffer(col.buffers()[1], np.uint8), bitorder="little")
            values.update(bits[col.offset:col.offset + len(col)].data)
        else:  # 8-byte integers: the data buffer is the canonical encoding
            w = col.type.bit_width // 8
            data = memoryview(col.buffers()[1])
            values.update(data[col.offset * w:(col.offset + len(col)) * w])

    def hexdigest(self) -> str:
        h = hashlib.sha256(f"{self.name}:{self.schema}".encode())
        for f in self.schema:
            values, lengths = self.h[f.name]
            h.update(values.digest() + lengths.digest())
        return h.hexdigest()


def combine(parts: list[str]) -> str:
    """The trace digest from the per-table digests, in TABLES order."""
    return hashlib.sha256("".join(parts).encode()).hexdigest()
