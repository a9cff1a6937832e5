"""Streaming, atomic trace writer (docs/trace.md).

Tables stream to Parquet in record batches as the run goes (bounded memory); everything is
written under `DIR.tmp-<pid>` and renamed to DIR only after the manifest, so an interrupted run
leaves no directory a reader would accept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sim.trace.reader import table_digest
from sim.trace.records import (
    FORMAT_VERSION,
    BlockEvent,
    RowRecord,
    StepRecord,
    Violation,
)
from sim.trace.schema import ROW_OF, SCHEMAS, TABLES

_FLUSH = 1 << 15


class TraceWriter:
    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.tmp = self.out.with_name(f"{self.out.name}.tmp-{os.getpid()}")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.writers = {n: pq.ParquetWriter(self.tmp / f"{n}.parquet", SCHEMAS[n],
                                            compression="zstd") for n in TABLES}
        self.buf: dict[str, list[tuple]] = {n: [] for n in TABLES}
        self.counts = dict.fromkeys(TABLES, 0)

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

    def _flush(self, table: str) -> None:
        b = self.buf[table]
        if not b:
            return
        schema = SCHEMAS[table]
        cols = list(zip(*b, strict=True))
        arrays = [pa.array(c, type=f.type) for c, f in zip(cols, schema, strict=True)]
        self.writers[table].write_table(pa.Table.from_arrays(arrays, schema=schema))
        self.counts[table] += len(b)
        b.clear()

    def close(self, violations: list[Violation], manifest: dict) -> Path:
        for v in violations:
            self.add("violations", v)
        for n in TABLES:
            self._flush(n)
            self.writers[n].close()
        tables = [pq.read_table(self.tmp / f"{n}.parquet") for n in TABLES]
        manifest = dict(manifest, format_version=FORMAT_VERSION,
                        counts={n: self.counts[n] for n in TABLES},
                        digest=table_digest(tables),
                        violations=self.counts["violations"], complete=True)
        (self.tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if self.out.exists():
            shutil.rmtree(self.out)
        os.replace(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        for w in self.writers.values():
            try:
                w.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)
