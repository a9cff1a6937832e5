"""`--isolate`: replay in a child process so a CUDA fault is pinned on its step and survived.

A device fault (illegal address) poisons the CUDA context, so nothing after it in that process
can run. The child syncs after every step and appends "start K" / "done K" to a progress file;
when it dies, the parent reads the last started step, records it as a fault with the child's
last error line, and starts a fresh child that skips the step (its kernels are not run; the
truth and the pool's events still advance). At most MAX_RESTARTS restarts.

Child: python -m gpu_backend.isolate TRACE BACKEND TOL SKIP_JSON RESULT_JSON PROGRESS
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from gpu_backend.result import ReplayResult
from gpu_backend.run import from_json, run_replay, to_json
from sim.errors import KvsimError

MAX_RESTARTS = 16


def replay_isolated(trace_dir: Path, backend: str, tol: float) -> ReplayResult:
    skip: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvsim-isolate-") as tmp:
        result, progress = Path(tmp) / "result.json", Path(tmp) / "progress"
        for _ in range(MAX_RESTARTS + 1):
            progress.write_text("")
            p = subprocess.run([sys.executable, "-m", "gpu_backend.isolate", str(trace_dir),
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
