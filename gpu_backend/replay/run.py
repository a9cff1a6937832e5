"""Entry points the CLI and the tools share: pick a backend, replay, serialize the result.

`--isolate`: replay in a child process so a CUDA fault is pinned on its step and survived.

A device fault (illegal address) poisons the CUDA context, so nothing after it in that process
can run. The child syncs after every step and appends "start K" / "done K" to a progress file;
when it dies, the parent reads the last started step, records it as a fault with the child's
last error line, and starts a fresh child that skips the step (its kernels are not run; the
truth and the pool's events still advance). At most MAX_RESTARTS restarts.

Child: python -m gpu_backend.replay.run TRACE BACKEND TOL SKIP_JSON RESULT_JSON PROGRESS
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gpu_backend.replay.cpu import ReferenceKernels
from gpu_backend.replay.loop import replay
from gpu_backend.trace import TraceData, load_trace
from gpu_backend.verdicts import ReplayResult, RowResult, max_ok_error
from sim.errors import KvsimError


class NoDeviceError(KvsimError):
    """--backend flashinfer without a CUDA device or without flashinfer installed."""


def make_kernels(backend: str, trace: TraceData, timing: bool = False,
                 graphs: bool = True) -> tuple[Any, str]:
    """(kernels, device) for `backend`; raises NoDeviceError/KvsimError, plainly worded.
    graphs: FlashInfer's steady steps as CUDA graphs (`gpu_backend.device.graphs`)."""
    m = trace.model
    if backend == "reference":
        return ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu"
    if backend != "flashinfer":
        raise KvsimError(f"--backend {backend!r}: choose flashinfer or reference")
    import torch

    if not torch.cuda.is_available():
        raise NoDeviceError("no CUDA device: --backend flashinfer needs an NVIDIA GPU "
                            "(use --backend reference on a CPU)")
    try:
        from gpu_backend.replay.flashinfer import FlashInferKernels
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

MAX_RESTARTS = 16


def replay_isolated(trace_dir: Path, backend: str, tol: float) -> ReplayResult:
    skip: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvsim-isolate-") as tmp:
        result, progress = Path(tmp) / "result.json", Path(tmp) / "progress"
        for _ in range(MAX_RESTARTS + 1):
            progress.write_text("")
            p = subprocess.run([sys.executable, "-m", "gpu_backend.replay.run", str(trace_dir),
                                backend, repr(tol), json.dumps(skip), str(result),
                                str(progress)], capture_output=True, text=True)
            if p.returncode == 0 and result.exists():
                return from_json(json.loads(result.read_text()))
            if p.returncode == 2:  # bad input: the child said why on stderr
                raise KvsimError(_last_line(p.stderr) or "replay child refused its input")
            step = _last_started(progress.read_text())
            if step is None or step in skip:
                raise KvsimError(f"replay child died outside a step (rc {p.returncode}): "
                                 f"{_last_line(p.stderr)}")
            skip[step] = f"device fault (rc {p.returncode}): {_last_line(p.stderr)}"
    raise KvsimError(f"more than {MAX_RESTARTS} faulting steps; giving up")


def _last_started(text: str) -> int | None:
    started = [int(line.split()[1]) for line in text.splitlines() if line.startswith("start ")]
    return started[-1] if started else None


def _last_line(err: str) -> str:
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    hits = [ln for ln in lines if "error" in ln.lower() or "illegal" in ln.lower()]
    return (hits or lines or [""])[-1][:300]


def _child(argv: list[str]) -> int:
    trace, backend, tol, skip_json, result, progress = argv
    skip = {int(k): v for k, v in json.loads(skip_json).items()}
    log = open(progress, "a", buffering=1)  # noqa: SIM115 - lives as long as the child

    def on_step(step: int, what: str) -> None:
        if what == "done" and backend == "flashinfer":
            import torch

            torch.cuda.synchronize()  # a fault surfaces here, inside its own step
        log.write(f"{what} {step}\n")

    try:
        res = run_replay(trace, backend, float(tol), skip=skip, on_step=on_step)
    except KvsimError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(result).write_text(json.dumps(to_json(res)))
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
