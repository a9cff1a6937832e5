"""The trace's content digest, computed as the tables stream (writer) or read back (reader).

One sha256 per column, fed value by value in a canonical encoding, so the digest depends on
column names, types and values only — not on record-batch boundaries, Parquet chunking or file
metadata — and the writer never has to read its own trace back to compute it.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class TableDigest:
    def __init__(self, name: str, schema: pa.Schema) -> None:
        self.name, self.schema = name, schema
        self.h = {f.name: (hashlib.sha256(), hashlib.sha256()) for f in schema}

    def update(self, batch: pa.RecordBatch | pa.Table) -> None:
        for f in self.schema:
            values, lengths = self.h[f.name]
            col = batch.column(f.name)
            if isinstance(col, pa.ChunkedArray):
                col = col.combine_chunks()
            if pa.types.is_list(f.type):
                lengths.update(pc.list_value_length(col).to_numpy(zero_copy_only=False)
                               .astype(np.int32).tobytes())
                col = pc.list_flatten(col)
                values.update(col.to_numpy(zero_copy_only=False).astype(np.int32).tobytes())
            elif pa.types.is_string(f.type):
                strs = [s.encode() for s in col.to_pylist()]
                lengths.update(np.fromiter(map(len, strs), np.int32, len(strs)).tobytes())
                values.update(b"".join(strs))
            else:
                arr = col.to_numpy(zero_copy_only=False)
                values.update(arr.astype(np.uint8 if arr.dtype == bool else arr.dtype).tobytes())

    def hexdigest(self) -> str:
        h = hashlib.sha256(f"{self.name}:{self.schema}".encode())
        for f in self.schema:
            values, lengths = self.h[f.name]
            h.update(values.digest() + lengths.digest())
        return h.hexdigest()


def combine(parts: list[str]) -> str:
    """The trace digest from the per-table digests, in TABLES order."""
    return hashlib.sha256("".join(parts).encode()).hexdigest()
