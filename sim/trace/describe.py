"""What each trace file says about itself: Parquet key-value metadata (docs/trace.md).

A trace is read by tools other than kvsim (duckdb, pandas, polars). rows.parquet's page and
position lists are stored as deltas (sim/trace/delta.py), so read raw they mislead; every file
therefore names its format_version and docs/trace.md, and rows.parquet says, column by column,
what is stored and how to decode it. Metadata never enters the digest (sim/trace/digest.py).
"""

from __future__ import annotations

import json

from sim.trace.records import FORMAT_VERSION

DOC = "docs/trace.md of kvsim (section 'rows.parquet on disk'; a DuckDB recipe decodes it)"

# rows.parquet's stored columns that are not what they are named, and the columns that decode
# them: `ordinal` is the 0-based row number in the file
ROWS_ENCODING: dict[str, str] = {
    "pages": "NOT the page table: only its tail. Full pages = the first pages_keep ids of the "
             "full pages of row prev_row, then these ids",
    "alloc": "NOT the allocated blocks: only their tail. Full alloc = the first alloc_keep ids "
             "of the full alloc of row prev_row, then these ids",
    "prev_row": "ordinal (0-based row number in this file) of an earlier row of the same "
                "request whose lists this row's start with; -1: none (keeps are 0, lists whole)",
    "pages_keep": "how many leading ids of row prev_row's full pages this row's pages keep",
    "alloc_keep": "how many leading ids of row prev_row's full alloc this row's alloc keeps",
    "append_pos": "NOT all positions: full append_pos = range(append_pos_start, "
                  "append_pos_start + append_pos_run), then these positions",
    "rope_pos": "NOT all positions: full rope_pos = range(rope_pos_start, "
                "rope_pos_start + rope_pos_run), then these positions",
    "append_pos_start": "first position of append_pos's leading run (0 when the run is empty)",
    "append_pos_run": "length of append_pos's leading run start, start + 1, ...",
    "rope_pos_start": "first position of rope_pos's leading run (0 when the run is empty)",
    "rope_pos_run": "length of rope_pos's leading run start, start + 1, ...",
}


def file_metadata(table: str) -> dict[str, str]:
    """Key-value metadata of `table`.parquet as the writer writes it (FORMAT_VERSION)."""
    meta = {"kvsim.format_version": str(FORMAT_VERSION), "kvsim.table": table,
            "kvsim.doc": DOC}
    if table == "rows":
        meta["kvsim.encoding"] = json.dumps(ROWS_ENCODING, indent=1)
        meta["kvsim.decode"] = ("pages, alloc, append_pos and rope_pos hold deltas: decode them "
                                "with kvsim (sim.trace.reader.read_trace) or the DuckDB recipe "
                                "of docs/trace.md before reading them as lists")
    return meta
