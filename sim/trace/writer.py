"""Streaming, atomic trace writer (docs/trace.md).

Tables stream to Parquet in record batches as the run goes (bounded memory); everything is
written under `DIR.tmp-<pid>` and renamed to DIR only after the manifest, so an interrupted run
leaves no directory a reader would accept. Callers hand over logical tables (SCHEMAS); the rows
table's page lists are delta-encoded on the way (sim/trace/delta.py), and the digest is over
what is stored (STORED).
"""

from __future__ import annotations

import functools
import json
import queue
import shutil
import threading
from collections.abc import Mapping
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sim import interrupt
from sim.outputs import Kind, publish, remove_stale, temp_path
from sim.trace.delta import RowEncoder
from sim.trace.describe import file_metadata
from sim.trace.digest import TableDigest, combine
from sim.trace.records import (
    FORMAT_VERSION,
    BlockEvent,
    RowRecord,
    StepRecord,
    Violation,
)
from sim.trace.schema import ROW_OF, SCHEMAS, STORED, TABLES

_ROW_GROUP = 1 << 16  # rows of column batches gathered into one Parquet row group
# ... or this many bytes, whichever comes first (the requests' token lists: 32 MiB groups left
# a ~80 ms row group for the writer to encode after the loop's end, at close)
_GROUP_BYTES = 8 << 20
_FLUSH = 1 << 13  # rows per record batch: bounds the buffered Python tuples


def _stat_columns(schema: pa.Schema) -> list[str]:
    """Min/max statistics for the columns readers filter on, step and request (a reader then
    skips row groups); none for the others: 10-15% of an integer column's encoding time, half a
    string column's (~0.1 CPU-s of the writer thread per 10k requests)."""
    return [f.name for f in schema if f.name in ("step", "request")]


# rows' columns whose consecutive values jump (rows interleave requests) but stay small:
# BYTE_STREAM_SPLIT + lz4 encodes them in half DELTA_BINARY_PACKED's time, to the same size or
# smaller (workload (a), 10k requests: ~0.1 CPU-s of the writer thread). Readers need
# pyarrow >= 16, DuckDB, polars (tested: 2.0, 2.1).
_SPLIT = ("row", "request", "q_len", "draft_len", "kv_indptr", "last_page_len", "shared_blocks",
          "accepted", "new_tokens", "prev_new_tokens", "max_pos", "prev_row", "pages_keep",
          "alloc_keep", "append_pos_run", "rope_pos_run")


def _delta_columns(schema: pa.Schema, split: tuple[str, ...] = ()) -> dict[str, str]:
    """Parquet's DELTA_BINARY_PACKED for signed integer columns and lists (steps, ordinals,
    positions, lengths: small steps from one value to the next), BYTE_STREAM_SPLIT for those
    in `split` and for token-id lists. On workload (a) delta halves rows.parquet and saves ~25%
    of its encoding; lz4 over it then saves another ~20% of the writer's time, against zstd,
    for ~5% more bytes."""
    out = {}
    for f in schema:
        if f.name in split:
            out[f.name] = "BYTE_STREAM_SPLIT"
        elif pa.types.is_signed_integer(f.type):
            out[f.name] = "DELTA_BINARY_PACKED"
        elif pa.types.is_list(f.type) and pa.types.is_signed_integer(f.type.value_type):
            # Parquet's leaf column
            out[f"{f.name}.list.element"] = ("BYTE_STREAM_SPLIT" if f.name in _TOKEN_IDS
                                             else "DELTA_BINARY_PACKED")
    return out


# token ids jump at random, so delta-packing them saves nothing; their bytes split into streams
# and lz4 takes the two high ones (ids < 2^16 here) away: 25-35% less encoding time than
# DELTA_BINARY_PACKED, ~2% fewer bytes (rows.tokens and the requests' lists, workload (a))
_TOKEN_IDS = ("tokens", "prompt_tokens", "output_tokens")


def _compression(schema: pa.Schema) -> dict[str, str]:
    return {(f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name): "lz4"
            for f in schema}


class TraceWriter:
    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.tmp = temp_path(self.out)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        remove_stale(self.out)
        self.tmp.mkdir(parents=True)
        # the metadata says what is stored (sim/trace/describe.py); the digest never sees it
        self.writers = {n: pq.ParquetWriter(self.tmp / f"{n}.parquet",
                                            STORED[n].with_metadata(file_metadata(n)),
                                            compression=_compression(STORED[n]),
                                            use_dictionary=False,
                                            column_encoding=_delta_columns(
                                                STORED[n], _SPLIT if n == "rows" else ()),
                                            write_statistics=_stat_columns(STORED[n]))
                        for n in TABLES}
        self.buf: dict[str, list[tuple]] = {n: [] for n in TABLES}
        self.counts = dict.fromkeys(TABLES, 0)
        self.batches: dict[str, list[pa.RecordBatch]] = {n: [] for n in TABLES}
        self.pending = {n: [0, 0] for n in TABLES}  # rows and bytes of self.batches[n]
        # over what is stored: the rows table's page lists delta-encoded, small; with the hash
        # of the format_version the manifest will name
        self.digests = {n: TableDigest(n, STORED[n], FORMAT_VERSION) for n in TABLES}
        self.encoder = RowEncoder()
        self.rows_encoded: bool | None = None  # who encodes the rows (add_columns `encoded`)
        # Parquet encoding and the digest run on a second thread (Arrow and the hashes release
        # the GIL): the simulation goes on meanwhile. Bounded, so a slow disk throttles the run,
        # not memory.
        self.q: queue.Queue = queue.Queue(maxsize=4)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._writer_loop, name="kvsim-trace-writer",
                                       daemon=True)
        self.thread.start()

    def _writer_loop(self) -> None:
        while (item := self.q.get()) is not None:
            if self.error is None:
                try:
                    self.writers[item[0]].write_table(item[1])
                    self.digests[item[0]].update(item[1])  # in write order, as the reader reads
                except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                    self.error = e

    def _write(self, table: str, data: pa.Table) -> None:
        interrupt.check()  # stop at the next batch, not at the end of the run
        if self.error is not None:
            raise self.error
        self.q.put((table, data))

    def _join(self) -> None:
        if self.thread.is_alive():
            self.q.put(None)
            self.thread.join()

    def add(self, table: str, rec: object) -> None:
        b = self.buf[table]
        b.append(ROW_OF[table](rec))
        if len(b) >= _FLUSH:
            self._flush(table)

    def on_step(self, step: StepRecord, rows: list[RowRecord], events: list[BlockEvent]) -> None:
        self.add("steps", step)
        for r in rows:
            self.add("rows", r)
        for e in events:
            self.add("blocks", e)

    def add_columns(self, table: str, cols: Mapping[str, object], encoded: bool = False,
                    keep: bool = False) -> None:
        """A batch already in columns (the fast engine): numpy arrays, Arrow arrays, or
        (offsets, values) for list columns, in schema order. Same digest as the same values
        added record by record. List columns' values and Arrow arrays are kept without a copy,
        and with `keep` numpy columns too: the caller must not write them afterwards. `encoded`
        rows come as stored (STORED: tails and DELTA_COLUMNS, by RowEncoder's rule); a run
        hands over all its rows one way."""
        self._flush(table)  # records added before go first (and through the row encoder first)
        batch = self._stored(table, cols, encoded, keep)
        if batch.num_rows == 0:
            return
        self.counts[table] += batch.num_rows
        self.batches[table].append(batch)
        size = self.pending[table]
        size[0] += batch.num_rows
        size[1] += batch.nbytes
        if size[0] >= _ROW_GROUP or size[1] >= _GROUP_BYTES:  # requests carry tokens
            self._write_batches(table)

    def _write_batches(self, table: str) -> None:
        """Small column batches become one row group (a row group per batch is 10x slower)."""
        pending = self.batches[table]
        if pending:
            self._write(table, pa.Table.from_batches(pending))
            pending.clear()
            self.pending[table] = [0, 0]

    def _flush(self, table: str) -> None:
        b = self.buf[table]
        if not b:
            return
        self._write_batches(table)  # column batches added before these records go first
        cols = {f.name: columnar(c, f.type)
                for c, f in zip(zip(*b, strict=True), SCHEMAS[table], strict=True)}
        batch = self._stored(table, cols)
        self._write(table, pa.Table.from_batches([batch]))
        self.counts[table] += len(b)
        b.clear()

    def _stored(self, table: str, cols: Mapping[str, object], encoded: bool = False,
                keep: bool = False) -> pa.RecordBatch:
        """Logical columns -> the record batch as stored (STORED): rows are delta-encoded."""
        if table == "rows":
            # prev_row counts rows from the first: two encoders in one trace would disagree
            if (self.rows_encoded is not None and self.rows_encoded != encoded
                    and self.counts["rows"]):
                raise ValueError("rows both encoded by the caller and by the writer: one way "
                                 "per trace")
            self.rows_encoded = encoded
            if not encoded:
                cols = self.encoder.encode(cols)
        schema = STORED[table]
        return pa.RecordBatch.from_arrays(
            [columnar_arrow(cols[f.name], f.type, keep) for f in schema], schema=schema)

    def close(self, violations: list[Violation], manifest: dict) -> Path:
        for v in violations:
            self.add("violations", v)
        for n in TABLES:
            self._flush(n)
            self._write_batches(n)
        self._join()
        if self.error is not None:
            raise self.error
        interrupt.check()  # never publish a run that was told to stop
        for n in TABLES:
            self.writers[n].close()
        manifest = dict(manifest, format_version=FORMAT_VERSION,
                        counts={n: self.counts[n] for n in TABLES},
                        digest=combine([self.digests[n].hexdigest() for n in TABLES]),
                        violations=self.counts["violations"], complete=True)
        (self.tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        publish(self.tmp, self.out, Kind.TRACE)  # never removes what is not an old trace
        return self.out

    def abort(self) -> None:
        self.error = self.error or RuntimeError("aborted")  # the thread drops what is queued
        self._join()
        for w in self.writers.values():
            try:
                w.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def columnar_arrow(v: object, t: pa.DataType, keep: bool = False) -> pa.Array:
    """numpy -> Arrow. A list column's values (the bulk: page ids) are kept without a copy;
    the caller hands them over (add_columns), as it does an Arrow array. Everything else is
    copied (the fast engine's checked runs reuse those buffers) unless `keep`: handed over."""
    if isinstance(v, tuple):  # list column
        offsets, values = v
        return pa.ListArray.from_arrays(from_numpy(np.array(offsets, np.int32), pa.int32()),
                                        from_numpy(values, pa.int32()))
    if isinstance(v, pa.Array):  # built by the caller (the fast engine's string columns)
        if not v.type.equals(t):
            raise TypeError(f"an Arrow column of type {v.type} where {t} is stored")
        return v
    if pa.types.is_string(t):  # few distinct values (phases, reasons, invariants)
        names, codes = np.unique(np.asarray(v).astype(str), return_inverse=True)
        return strings(codes, tuple(names.tolist()))
    dtype = {pa.bool_(): bool, pa.uint64(): np.uint64}.get(t, np.int64)
    return from_numpy(np.asarray(v, dtype) if keep else np.array(v, dtype), t)


def from_numpy(a: np.ndarray, t: pa.DataType) -> pa.Array:
    """pa.array(a, t) for a 1-D numpy array already of t's width, over a's memory (no copy).
    pa.array imports pandas on its first call: ~0.15 s of a traced run's start-up, on the
    thread that feeds the writer."""
    if pa.types.is_boolean(t):
        bits = np.packbits(np.asarray(a, bool), bitorder="little")
        return pa.Array.from_buffers(t, len(a), [None, pa.py_buffer(bits)])
    a = np.ascontiguousarray(a, _NUMPY[t])
    return pa.Array.from_buffers(t, len(a), [None, pa.py_buffer(a)])


def strings(codes: np.ndarray, names: tuple[str, ...]) -> pa.Array:
    """names[codes] as an Arrow string column, built in C: converting Python strings costs ~8x
    more. From buffers, not pa.array: its first call imports pandas (~0.15 s), which no traced
    run needs otherwise."""
    idx, table = np.ascontiguousarray(codes, np.int64), _names(names)
    if not len(idx):  # every drain without detail: take's fixed ~50 µs would add up
        return table[:0]
    return table.take(pa.Array.from_buffers(pa.int64(), len(idx), [None, pa.py_buffer(idx)]))


@functools.lru_cache
def _names(names: tuple[str, ...]) -> pa.Array:
    data = [s.encode() for s in names]
    offsets = np.cumsum([0, *map(len, data)], dtype=np.int32)
    return pa.StringArray.from_buffers(len(data), pa.py_buffer(offsets),
                                       pa.py_buffer(b"".join(data)))


_NUMPY = {pa.int32(): np.int32, pa.int64(): np.int64, pa.uint64(): np.uint64,
          pa.float64(): np.float64}


def columnar(values: tuple | list, t: pa.DataType) -> object:
    """Python values -> the numpy column add_columns takes ((offsets, values) for a list)."""
    n = len(values)
    if pa.types.is_list(t):
        lengths = np.fromiter(map(len, values), np.int32, n)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        return offsets, np.fromiter(chain.from_iterable(values), np.int32, int(offsets[-1]))
    if pa.types.is_string(t):
        return np.array(values, dtype=object)
    dtype = {pa.bool_(): bool, pa.uint64(): np.uint64}.get(t, np.int64)
    return np.fromiter(values, dtype, n)


def to_arrow(values: tuple | list, t: pa.DataType) -> pa.Array:
    """Python values -> Arrow through numpy (pa.array on tuples of lists is several times
    slower, and imports pandas)."""
    return columnar_arrow(columnar(values, t), t)
