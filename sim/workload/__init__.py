"""Workload: the `[workload]` section of a scenario → a deterministic list of requests.

Three sources, exactly one per scenario (see `config.py` for the TOML):

- `requests`: explicit requests (`explicit.py`), for fuzzing and shrunk regressions;
- `synthetic`: seeded Poisson/gamma arrivals, length distributions, shared prefixes and chat
  sessions (`synthetic.py`), vectorized so a million requests plan in well under a second;
- `trace`: the public Azure 2023 and Mooncake traces (`traces.py`, `readers.py`); a missing
  file is an error, and its synthetic `fallback` runs only when asked for (`source.stand_in`).

Everything random comes from the generator the caller passes (one per subsystem, docs/design.md §4)
or from stable functions of trace content; never Python's `hash()` or the clock. Same config and
seed ⇒ identical arrays. Token ids of generated prompts are made lazily (`content.py`), so
`iter_workload` runs a million-request workload in bounded memory; `build_workload` is its list.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sim.workload.config import (
    ExplicitRequest,
    SyntheticConfig,
    TraceConfig,
    WorkloadConfig,
)
from sim.workload.content import iter_plan
from sim.workload.explicit import build_explicit
from sim.workload.source import missing_trace, stand_in, synthetic_source, trace_source
from sim.workload.spec import RequestSpec, WorkloadError
from sim.workload.synthetic import plan_synthetic
from sim.workload.traces import read_trace, resolve_trace, trace_requests, tried_paths

__all__ = [
    "ExplicitRequest",
    "RequestSpec",
    "SyntheticConfig",
    "TraceConfig",
    "WorkloadConfig",
    "WorkloadError",
    "build_workload",
    "iter_workload",
    "open_workload",
    "stand_in",
]


def iter_workload(cfg: WorkloadConfig, rng: np.random.Generator, *, tokens_per_block: int,
                  base_dir: Path | None = None) -> Iterator[RequestSpec]:
    """The requests of `cfg` in arrival order, made as they are consumed.

    Everything that can fail (a missing or malformed trace) fails here, before the first request.
    Args:
        rng: the workload's own generator; this call draws from it.
        tokens_per_block: the KV block size B. Content never depends on it, so a sweep over B
            sees identical requests; it is checked here and kept for block-aware sources.
        base_dir: the scenario file's folder, against which relative trace paths resolve.
    Raises:
        WorkloadError: the trace file is absent or has a bad row (a trace's `fallback` runs
            only through `stand_in`, never in the file's place by itself).
    """
    return open_workload(cfg, rng, tokens_per_block=tokens_per_block, base_dir=base_dir)[0]


def open_workload(cfg: WorkloadConfig, rng: np.random.Generator, *, tokens_per_block: int,
                  base_dir: Path | None = None) -> tuple[Iterator[RequestSpec], dict]:
    """`iter_workload`'s requests and the record of their source (`source.py`)."""
    if tokens_per_block < 1:
        raise WorkloadError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if cfg.requests is not None:
        return iter(build_explicit(cfg, rng)), {"source": "requests",
                                                "requests": len(cfg.requests)}
    if cfg.synthetic is not None:
        return iter_plan(plan_synthetic(cfg.synthetic, rng)), synthetic_source(cfg.synthetic)
    trace = cfg.trace
    assert trace is not None, "WorkloadConfig validation guarantees one source; a bug"
    file = resolve_trace(trace.path, base_dir)
    if file is None:
        raise missing_trace(trace, tried_paths(trace.path, base_dir))
    rows = read_trace(trace, file)
    return (trace_requests(trace, rows, rng),
            trace_source(trace, file, len(rows.arrival_ns)))


def build_workload(cfg: WorkloadConfig, rng: np.random.Generator, *, tokens_per_block: int,
                   base_dir: Path | None = None) -> list[RequestSpec]:
    """All requests of `cfg`, in arrival order (see `iter_workload`)."""
    requests = iter_workload(cfg, rng, tokens_per_block=tokens_per_block, base_dir=base_dir)
    # A million new objects set off the cyclic collector again and again (about doubling the
    # build time) though none of them can form a cycle: pause it for the build.
    paused = gc.isenabled()
    gc.disable()
    try:
        return list(requests)
    finally:
        if paused:
            gc.enable()
