"""Entry points the CLI and the tools share: pick a backend, replay, serialize the result."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpu_backend.driver import replay
from gpu_backend.result import ReplayResult, RowResult, max_ok_error
from gpu_backend.tracedata import TraceData, load_trace
from sim.errors import KvsimError


class NoDeviceError(KvsimError):
    """--backend flashinfer without a CUDA device or without flashinfer installed."""


def make_kernels(backend: str, trace: TraceData, timing: bool = False,
                 graphs: bool = True) -> tuple[Any, str]:
    """(kernels, device) for `backend`; raises NoDeviceError/KvsimError, plainly worded.
    graphs: FlashInfer's steady steps as CUDA graphs (`gpu_backend.graphs`)."""
    m = trace.model
    if backend == "reference":
        from gpu_backend.reference import ReferenceKernels

        return ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu"
    if backend != "flashinfer":
        raise KvsimError(f"--backend {backend!r}: choose flashinfer or reference")
    import torch

    if not torch.cuda.is_available():
        raise NoDeviceError("no CUDA device: --backend flashinfer needs an NVIDIA GPU "
                            "(use --backend reference on a CPU)")
    try:
        from gpu_backend.replay import FlashInferKernels
    except ImportError as e:
        raise NoDeviceError(f"flashinfer is not importable ({e}); install flashinfer-python") \
            from None
    return FlashInferKernels(m.num_q_heads, "cuda", timing=timing, graphs=graphs), "cuda"


def run_replay(trace_dir: str | Path, backend: str, tol: float,
               skip: dict[int, str] | None = None, on_step: Any = None,
               watch: str = "incremental", graphs: bool = True) -> ReplayResult:
    trace = load_trace(trace_dir)
    kernels, device = make_kernels(backend, trace, graphs=graphs)
    return replay(trace, kernels, device, tol, skip=skip, on_step=on_step, watch=watch)


def to_json(res: ReplayResult) -> dict[str, Any]:
    return {"trace": res.trace, "backend": res.backend, "tol": res.tol, "counts": res.counts(),
            "max_ok_err": max_ok_error(res), "stats": res.stats, "watch": res.watch,
            "rows": [asdict(r) for r in res.rows]}


def from_json(d: dict[str, Any]) -> ReplayResult:
    res = ReplayResult(d["backend"], d["trace"], d["tol"], stats=d.get("stats", {}),
                       watch=d.get("watch", ""))
    res.rows = [RowResult(**r) for r in d["rows"]]
    return res


def write_json(res: ReplayResult, out: Path, extra: dict[str, Any] | None = None) -> None:
    """Atomically; the leading "kvsim" key marks the file as a replay's (sim/outputs.py)."""
    from sim.outputs import Kind, write_file

    write_file(out, json.dumps({"kvsim": "replay", **to_json(res), **(extra or {})}, indent=1),
               Kind.REPLAY)
