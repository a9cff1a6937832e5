"""The CPU reference replay's speed: `kvsim replay TRACE --backend reference`, timed.

python bench/cpu_replay.py [TRACE_DIR] [--steps N] [--reps R] [--json OUT]

Without TRACE_DIR it replays the trace of `make run`'s scenario (scenarios/default.toml: 200
requests, 2,032 steps, 11,933 rows), written first under --work. This is what a user without a
GPU waits for, and what CI's replay tests run on. --steps N replays the first N steps only
(a quicker figure; the steps differ in cost: the prompts are spread over the run). Reports the
median wall of --reps replays, the first included (numba's compiled preparation loads from
its cache), steps/s and rows/s, and the verdict counts (they must not change with speed work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from environment import ROOT, environment, positive

sys.path.insert(0, str(ROOT))

from gpu_backend.replay.loop import replay
from gpu_backend.replay.run import make_kernels
from gpu_backend.trace import load_trace
from sim.errors import KvsimError  # noqa: E402


def _default_trace(work: Path) -> Path:
    from sim.api import load_scenario, run

    out = work / "default"
    if not (out / "manifest.json").exists():
        sc, base = load_scenario(ROOT / "scenarios" / "default.toml")
        run(sc, out=out, base_dir=base)
    return out


def measure(path: Path, steps: int | None, reps: int) -> dict[str, Any]:
    walls: list[float] = []
    counts: dict[str, int] = {}
    for _ in range(reps):
        trace = load_trace(path)  # replay keeps no state in it, but a fresh one is the CLI's
        if steps is not None:
            trace.steps = trace.steps[:steps]
        kernels, device = make_kernels("reference", trace)
        t0 = time.perf_counter()
        res = replay(trace, kernels, device)
        walls.append(time.perf_counter() - t0)
        counts = res.counts()
    n_steps = len(trace.steps)
    n_rows = sum(len(trace.rows.get(s.step, ())) for s in trace.steps)
    wall = statistics.median(walls)
    return {"trace": str(path), "steps": n_steps, "rows": n_rows, "walls_s": walls,
            "wall_s": wall, "steps_per_s": n_steps / wall, "rows_per_s": n_rows / wall,
            "verdicts": counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("trace", nargs="?", type=Path, help="a trace directory (default: make run's)")
    ap.add_argument("--steps", type=positive, help="replay the first N steps only")
    ap.add_argument("--reps", type=positive, default=1, help="replays (default 1)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvsim-cpu-replay"),
                    help="where the default trace is written")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--note", default="", help="context to keep in the JSON")
    a = ap.parse_args()
    try:
        path = a.trace if a.trace is not None else _default_trace(a.work)
        load_trace(path)  # a bad directory is a usage error before anything is timed
    except KvsimError as e:
        ap.error(str(e))
    r = measure(path, a.steps, a.reps)
    print(f"{r['steps']} steps, {r['rows']} rows: {r['wall_s']:.1f} s "
          f"({r['steps_per_s']:.1f} steps/s, {r['rows_per_s']:.0f} rows/s); {r['verdicts']}")
    if a.json:
        out = environment() | ({"note": a.note} if a.note else {}) | r
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(a.json)


if __name__ == "__main__":
    main()
