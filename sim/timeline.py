"""Chrome trace-event JSON of a trace, for Perfetto (ui.perfetto.dev) or chrome://tracing.

Lanes: process 1 "engine" has a host thread (schedule spans t_sched..t_launch) and a device
thread (forward spans t_dev_start..t_dev_end), so overlap shows as host spans running under device
spans; a "kv blocks" counter (used / free / cached). Process 2 "requests" has one async track per
request: arrival→finish, split into waiting (arrival→first token) and decoding (→finish).
Events are written one at a time to a temporary file, then renamed: memory stays flat on large
traces and a crash never leaves a half file under the final name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pyarrow as pa

from sim.outputs import Kind, file_temp, publish

ENGINE, REQUESTS = 1, 2
HOST, DEVICE = 1, 2


def _us(ns: int) -> float:
    return ns / 1000


def _meta() -> Iterator[dict]:
    yield {"ph": "M", "name": "process_name", "pid": ENGINE, "args": {"name": "engine"}}
    yield {"ph": "M", "name": "process_name", "pid": REQUESTS, "args": {"name": "requests"}}
    yield {"ph": "M", "name": "thread_name", "pid": ENGINE, "tid": HOST, "args": {"name": "host"}}
    yield {"ph": "M", "name": "thread_name", "pid": ENGINE, "tid": DEVICE,
           "args": {"name": "device"}}


def _step_events(s: dict) -> Iterator[dict]:
    k = s["step"]
    yield {"ph": "X", "name": f"schedule {k}", "cat": "host", "pid": ENGINE, "tid": HOST,
           "ts": _us(s["t_sched_ns"]), "dur": _us(s["t_launch_ns"] - s["t_sched_ns"]),
           "args": {"step": k, "processed_step": s.get("processed_step", -1)}}
    yield {"ph": "X", "name": f"forward {k}", "cat": "device", "pid": ENGINE, "tid": DEVICE,
           "ts": _us(s["t_dev_start_ns"]), "dur": _us(s["t_dev_end_ns"] - s["t_dev_start_ns"]),
           "args": {"step": k, "rows": s["num_rows"], "ctx": s["num_ctx"], "gen": s["num_gen"],
                    "tokens": s["num_tokens"]}}
    yield {"ph": "C", "name": "kv blocks", "pid": ENGINE, "ts": _us(s["t_launch_ns"]),
           "args": {"used": s["blocks_used"], "free": s["blocks_free"],
                    "cached": s["blocks_cached"]}}


def _async(name: str, rid: int, ph: str, ts_ns: int, args: dict | None = None) -> dict:
    ev = {"ph": ph, "name": name, "cat": "request", "id": rid, "pid": REQUESTS,
          "ts": _us(ts_ns)}
    if args:
        ev["args"] = args
    return ev


def _request_events(r: dict) -> Iterator[dict]:
    rid, arr, first, fin = r["request"], r["arrival_ns"], r["first_token_ns"], r["finish_ns"]
    if fin < arr:  # rejected or unfinished: nothing to draw
        return
    args = {"prompt_len": r["prompt_len"], "reused": r["reused_tokens"],
            "outputs": len(r["output_tokens"]), "finish": r["finish_reason"],
            "preemptions": r["num_preemptions"]}
    yield _async(f"request {rid}", rid, "b", arr, args)
    if arr <= first <= fin:
        yield _async("waiting", rid, "b", arr)
        yield _async("waiting", rid, "e", first)
        yield _async("decoding", rid, "b", first)
        yield _async("decoding", rid, "e", fin)
    yield _async(f"request {rid}", rid, "e", fin)


def _rows(table: pa.Table, columns: list[str]) -> Iterator[dict]:
    cols = [c for c in columns if c in table.column_names]
    for batch in table.select(cols).to_batches(max_chunksize=4096):
        yield from batch.to_pylist()


def _events(steps: pa.Table, requests: pa.Table) -> Iterator[dict]:
    yield from _meta()
    step_cols = ["step", "t_sched_ns", "t_launch_ns", "t_dev_start_ns", "t_dev_end_ns",
                 "num_rows", "num_ctx", "num_gen", "num_tokens", "blocks_used", "blocks_free",
                 "blocks_cached", "processed_step"]
    for s in _rows(steps, step_cols):
        yield from _step_events(s)
    req_cols = ["request", "arrival_ns", "first_token_ns", "finish_ns", "prompt_len",
                "reused_tokens", "output_tokens", "finish_reason", "num_preemptions"]
    for r in _rows(requests, req_cols):
        yield from _request_events(r)


def _write(fh: IO[str], events: Iterator[dict]) -> int:
    fh.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
    n = 0
    for ev in events:
        fh.write((",\n" if n else "") + json.dumps(ev, separators=(",", ":")))
        n += 1
    fh.write("\n]}\n")
    return n


def write_timeline(steps: pa.Table, requests: pa.Table, out: str | Path) -> int:
    """Write the Chrome trace JSON of a run to `out` atomically; returns the events written."""
    out = Path(out)
    tmp = file_temp(out)
    try:
        with tmp.open("w") as fh:
            n = _write(fh, _events(steps, requests))
        publish(tmp, out, Kind.TIMELINE)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def trace_timeline(trace_dir: str | Path, out: str | Path) -> int:
    """Chrome trace JSON of a trace directory. Raises TraceError on a missing or partial trace."""
    from sim.metrics import load_trace_tables

    _, t = load_trace_tables(trace_dir)
    return write_timeline(t["steps"], t["requests"], out)
