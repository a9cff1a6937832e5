"""Streaming, atomic trace writer (docs/trace.md).

Tables stream to Parquet in record batches as the run goes (bounded memory); everything is
written under `DIR.tmp-<pid>` and renamed to DIR only after the manifest, so an interrupted run
leaves no directory a reader would accept.
"""

from __future__ import annotations

import glob
import json
import os
import queue
import shutil
import threading
from collections.abc import Mapping
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sim.trace.digest import TableDigest, combine
from sim.trace.records import (
    FORMAT_VERSION,
    BlockEvent,
    RowRecord,
    StepRecord,
    Violation,
)
from sim.trace.schema import ROW_OF, SCHEMAS, TABLES

_ROW_GROUP = 1 << 16  # rows of column batches gathered into one Parquet row group
_GROUP_BYTES = 32 << 20  # ... or this many bytes, whichever comes first
_FLUSH = 1 << 13  # rows per record batch: bounds the buffered Python tuples


def _stat_columns(schema: pa.Schema) -> list[str]:
    """Min/max statistics for scalar columns (a reader filtering on step or request skips row
    groups with them); none for list columns: ~10% of their encoding time, no use to readers."""
    return [f.name for f in schema if not pa.types.is_list(f.type)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove `out.tmp-<pid>` left by killed writers (SIGKILL runs no cleanup); a live pid's
    directory is another run in progress and is kept."""
    gone = []
    for p in out.parent.glob(f"{glob.escape(out.name)}.tmp-*"):
        pid = p.name.rpartition(".tmp-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


class TraceWriter:
    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.tmp = self.out.with_name(f"{self.out.name}.tmp-{os.getpid()}")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        remove_stale(self.out)
        self.tmp.mkdir(parents=True)
        self.writers = {n: pq.ParquetWriter(self.tmp / f"{n}.parquet", SCHEMAS[n],
                                            compression="zstd", use_dictionary=False,
                                            write_statistics=_stat_columns(SCHEMAS[n]))
                        for n in TABLES}
        self.buf: dict[str, list[tuple]] = {n: [] for n in TABLES}
        self.counts = dict.fromkeys(TABLES, 0)
        self.batches: dict[str, list[pa.RecordBatch]] = {n: [] for n in TABLES}
        self.digests = {n: TableDigest(n, SCHEMAS[n]) for n in TABLES}
        # Parquet encoding runs on a second thread (Arrow releases the GIL): the simulation and
        # the digest go on meanwhile. Bounded, so a slow disk throttles the run, not memory.
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
                except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                    self.error = e

    def _write(self, table: str, data: pa.Table) -> None:
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

    def add_columns(self, table: str, cols: Mapping[str, object]) -> None:
        """A batch already in columns (the fast engine): numpy arrays, or (offsets, values) for
        list columns, in schema order. Same digest as the same values added record by record.
        List columns' values are kept without a copy: the caller must not write them afterwards."""
        schema = SCHEMAS[table]
        batch = pa.RecordBatch.from_arrays(
            [columnar_arrow(cols[f.name], f.type) for f in schema], schema=schema)
        if batch.num_rows == 0:
            return
        self._flush(table)  # keep any records added before, in order
        self.digests[table].update(batch)
        self.counts[table] += batch.num_rows
        pending = self.batches[table]
        pending.append(batch)
        if (sum(b.num_rows for b in pending) >= _ROW_GROUP
                or sum(b.nbytes for b in pending) >= _GROUP_BYTES):  # requests carry tokens
            self._write_batches(table)

    def _write_batches(self, table: str) -> None:
        """Small column batches become one row group (a row group per batch is 10x slower)."""
        pending = self.batches[table]
        if pending:
            self._write(table, pa.Table.from_batches(pending))
            pending.clear()

    def _flush(self, table: str) -> None:
        b = self.buf[table]
        if not b:
            return
        schema = SCHEMAS[table]
        self._write_batches(table)  # column batches added before these records go first
        cols = list(zip(*b, strict=True))
        batch = pa.RecordBatch.from_arrays(
            [to_arrow(c, f.type) for c, f in zip(cols, schema, strict=True)], schema=schema)
        self._write(table, pa.Table.from_batches([batch]))
        self.digests[table].update(batch)
        self.counts[table] += len(b)
        b.clear()

    def close(self, violations: list[Violation], manifest: dict) -> Path:
        for v in violations:
            self.add("violations", v)
        for n in TABLES:
            self._flush(n)
            self._write_batches(n)
        self._join()
        if self.error is not None:
            raise self.error
        for n in TABLES:
            self.writers[n].close()
        manifest = dict(manifest, format_version=FORMAT_VERSION,
                        counts={n: self.counts[n] for n in TABLES},
                        digest=combine([self.digests[n].hexdigest() for n in TABLES]),
                        violations=self.counts["violations"], complete=True)
        (self.tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
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


def columnar_arrow(v: object, t: pa.DataType) -> pa.Array:
    """numpy -> Arrow. A list column's values (the bulk: page ids) are kept without a copy;
    the caller hands them over (add_columns). Everything else is copied: the fast engine's
    scalar columns are views of buffers it reuses."""
    if isinstance(v, tuple):  # list column
        offsets, values = v
        return pa.ListArray.from_arrays(pa.array(np.array(offsets, np.int32)),
                                        pa.array(np.ascontiguousarray(values, np.int32)))
    if pa.types.is_string(t):
        return pa.array(np.asarray(v), pa.string())
    dtype = {pa.bool_(): bool, pa.uint64(): np.uint64}.get(t, np.int64)
    return pa.array(np.array(v, dtype), t)


def to_arrow(values: tuple | list, t: pa.DataType) -> pa.Array:
    """Python values -> Arrow through numpy (pa.array on tuples of lists is several times
    slower, and imports pandas)."""
    n = len(values)
    if pa.types.is_list(t):
        lengths = np.fromiter(map(len, values), np.int32, n)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter(chain.from_iterable(values), np.int32, int(offsets[-1]))
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    if pa.types.is_string(t):
        return pa.array(list(values), pa.string())
    dtype = {pa.bool_(): bool, pa.uint64(): np.uint64}.get(t, np.int64)
    return pa.array(np.fromiter(values, dtype, n), t)
