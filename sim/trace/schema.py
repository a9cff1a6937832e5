"""Arrow schemas of the trace tables, derived from the record dataclasses (one source of truth)."""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter

import pyarrow as pa

from sim.trace.records import BlockEvent, RequestRecord, RowRecord, StepRecord, Violation

_TYPES = {"int": pa.int64(), "str": pa.string(), "bool": pa.bool_(),
          "tuple[int, ...]": pa.list_(pa.int32())}


def _schema(cls: type) -> pa.Schema:
    cols = []
    for f in fields(cls):
        t = pa.uint64() if f.name == "hash" else _TYPES[str(f.type)]
        cols.append(pa.field(f.name, t, nullable=False))
    return pa.schema(cols)


SCHEMAS: dict[str, pa.Schema] = {
    "steps": _schema(StepRecord),
    "rows": _schema(RowRecord),
    "requests": _schema(RequestRecord),
    "blocks": _schema(BlockEvent),
    "violations": _schema(Violation),
}
TABLES = tuple(SCHEMAS)  # order of the digest
RECORDS = {"steps": StepRecord, "rows": RowRecord, "requests": RequestRecord,
           "blocks": BlockEvent, "violations": Violation}

# record -> tuple of its fields in schema order; dataclasses.astuple deep-copies (10x slower).
ROW_OF = {name: attrgetter(*(f.name for f in fields(cls))) for name, cls in RECORDS.items()}
