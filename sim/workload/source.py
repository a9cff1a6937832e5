"""Where a run's requests came from, as the trace manifest and `kvsim run --json` record it.

A trace scenario runs its trace file or fails: its synthetic `fallback` runs only when the
user asks for it (`kvsim run --synthetic-workload`), and the record then says it stood in.

    {"source": "trace", "format": "mooncake", "path": "/abs/conversation_trace.jsonl",
     "sha256": "…", "rows": 60}
    {"source": "synthetic", "generator": {…}, "stand_in_for": {"path": "…", "format": "…"}}
    {"source": "requests", "requests": 3}
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from sim.workload.config import SyntheticConfig, TraceConfig, WorkloadConfig
from sim.workload.spec import WorkloadError

_CHUNK = 1 << 20


def stand_in(cfg: WorkloadConfig) -> WorkloadConfig:
    """The synthetic workload that `workload.trace.fallback` describes, in place of the trace.

    Raises:
        WorkloadError: the workload is not a trace, or its scenario has no fallback.
    """
    if cfg.trace is None or cfg.trace.fallback is None:
        kind = "workload.trace without workload.trace.fallback" if cfg.trace else (
            "workload.synthetic" if cfg.synthetic else "workload.requests")
        raise WorkloadError("--synthetic-workload: a scenario whose workload.trace has a "
                            f"workload.trace.fallback to run instead (got {kind})")
    return WorkloadConfig(synthetic=cfg.trace.fallback)


def trace_source(cfg: TraceConfig, file: Path, rows: int) -> dict:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return {"source": "trace", "format": cfg.format, "path": str(file),
            "sha256": digest.hexdigest(), "rows": rows}


def synthetic_source(cfg: SyntheticConfig) -> dict:
    return {"source": "synthetic", "generator": cfg.model_dump(mode="json")}


def stood_in(record: dict, trace: TraceConfig) -> dict:
    """`record` (a synthetic one) marked as run in place of `trace`."""
    return record | {"stand_in_for": {"path": trace.path, "format": trace.format}}


def missing_trace(cfg: TraceConfig, tried: str) -> WorkloadError:
    hint = (", or --synthetic-workload to run workload.trace.fallback instead"
            if cfg.fallback is not None else "")
    return WorkloadError(f"workload.trace.path: an existing {cfg.format} trace file{hint} "
                         f"(got {cfg.path!r}: no such file; tried {tried})")
