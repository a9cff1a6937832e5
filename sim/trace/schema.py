"""Arrow schemas of the trace tables, derived from the record dataclasses (one source of truth).

`SCHEMAS` are the logical tables everything downstream sees; `STORED` is what format_versions 2
and 3 put on disk: rows.parquet adds the columns of its delta-encoded page lists
(sim/trace/delta.py). Formats 2 and 3 store the same; only their digest's hash differs.
"""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter

import pyarrow as pa

from sim.trace.records import (
    READABLE_VERSIONS,
    BlockEvent,
    RequestRecord,
    RowRecord,
    StepRecord,
    Violation,
)

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
# rows.parquet on disk: `pages` and `alloc` hold only the tail after the ids kept from `prev_row`
DELTA_COLUMNS = ("prev_row", "pages_keep", "alloc_keep")
# ... and from format 3, `append_pos` and `rope_pos` only what follows their leading run
# start, start + 1, ... (all of a row's positions, at nearly every row)
RUN_LISTS = ("append_pos", "rope_pos")
RUN_COLUMNS = tuple(f"{n}_{c}" for n in RUN_LISTS for c in ("start", "run"))


def _with(*cols: str) -> dict[str, pa.Schema]:
    return dict(SCHEMAS, rows=pa.schema(
        [*SCHEMAS["rows"], *(pa.field(c, pa.int64(), nullable=False) for c in cols)]))


STORED_V2 = _with(*DELTA_COLUMNS)
STORED = _with(*DELTA_COLUMNS, *RUN_COLUMNS)  # what the writer writes (FORMAT_VERSION)
ON_DISK = {1: SCHEMAS, 2: STORED_V2, 3: STORED}  # format_version -> the schemas of its files
assert tuple(ON_DISK) == READABLE_VERSIONS, "a readable format_version without its schemas"
RECORDS = {"steps": StepRecord, "rows": RowRecord, "requests": RequestRecord,
           "blocks": BlockEvent, "violations": Violation}

# record -> tuple of its fields in schema order; dataclasses.astuple deep-copies (10x slower).
ROW_OF = {name: attrgetter(*(f.name for f in fields(cls))) for name, cls in RECORDS.items()}
