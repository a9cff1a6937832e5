"""Replay throughput on the GPU: wall time per step vs the kernels' own time (CUDA events).

python bench/gpu_replay.py TRACE_DIR [--json OUT]   (TRACE_DIR: e.g. tests/unit/replay_traces.py
--big writes big_verify: batch 64, kv_len ~2k, MTP W=4, Llama-3.1-8B heads)

Kernel time = append + attention launches of a step, between CUDA events. Wall time = the whole
replay step (content, truth, kernels, checksums, fp32 reference, verdicts), measured from a
device sync before the first generation step to one after the last, divided by the step count.
The first step (the prompts' prefill) and a first full pass (JIT, warm-up) are excluded.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpu_backend.calibrate import meta
from gpu_backend.driver import max_ok_error, replay
from gpu_backend.replay import FlashInferKernels
from gpu_backend.tracedata import load_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile a third, untimed pass (host time)")
    ap.add_argument("--commit", default="",
                    help="commit to record (default: git rev-parse; the device copy has no .git)")
    a = ap.parse_args()
    trace = load_trace(a.trace)
    first, last = trace.steps[1].step, trace.steps[-1].step
    timed: tuple = ()
    for attempt in range(3 if a.profile else 2):  # pass 0 JIT-compiles and warms up
        k = FlashInferKernels(trace.model.num_q_heads, "cuda", timing=True)
        marks: dict[str, float] = {}

        def on_step(step: int, what: str, marks: dict[str, float] = marks) -> None:
            if (step, what) in ((first, "start"), (last, "done")):
                torch.cuda.synchronize()
                marks[what] = time.perf_counter()

        prof = cProfile.Profile() if attempt == 2 else None  # profiled pass: not timed
        if prof:
            prof.enable()
        res = replay(trace, k, "cuda", on_step=on_step)
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        if attempt == 1:
            timed = (k.kernel_ms()[1:], dict(marks), res)
    ms, marks, res = timed
    n = len(ms)
    wall = (marks["done"] - marks["start"]) * 1e3 / n
    kern = sum(ms) / n
    rows = [r for r in res.rows if r.step >= first]
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip()
    out = meta("python bench/gpu_replay.py " + " ".join(sys.argv[1:])) | {"commit": commit}
    out |= {"trace": str(a.trace), "steps": n, "batch": len(trace.rows[first]),
           "kv_len_max": max(r.kv_len for r in trace.rows[last]), "wall_ms_per_step": wall,
           "kernel_ms_per_step": kern, "ratio": wall / kern, "counts": res.counts(),
           "max_ok_err": max_ok_error(res), "rows_checked": len(rows)}
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
