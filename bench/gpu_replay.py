"""Replay throughput on the GPU: wall time per step vs the kernels' own time (CUDA events).

python bench/gpu_replay.py TRACE_DIR [--json OUT] [--profile]   (TRACE_DIR: e.g.
tests/unit/replay_traces.py --big writes big_verify: batch 64, kv_len ~2k, MTP W=4, Llama-3.1-8B
heads)

Passes over the whole trace, each with fresh kernels (pass 0 JIT-compiles and warms up):
- wall (two passes, `wall_ms_per_step` and `repeat`): the whole replay step (content, truth,
  kernels, checksums, fp32 reference, per-token errors), from a device sync before the first
  generation step to one after the last, divided by the step count; no events, no spins. The
  first step (the prompts' prefill) is excluded, and so is the host preparation (`prepare`), which
  runs ahead of the steps: it is reported beside (`prepare_ms_per_step`, `ratio_incl_prepare`).
- kernels: each append and attention launch between CUDA events, after a GPU spin so the start
  event fires once the host has queued the launch: the kernels' device time, no host gaps. (Until
  2026-12-01 the events bracketed the step's launches with FlashInfer's plan() between them, so
  the host's planning time counted as kernel time: 0.51-0.61 ms there vs 0.15 ms of kernels.)
- host_wait_ms_per_step: of the wall, the time the host waited for the device (the plan
  fences, `FlashInferKernels.wait_s`): near 0 means the host is the bottleneck, near the wall
  minus the host's own queueing time means the device is.
- --profile: a cProfile of one more, untimed pass (host time by function).
- --before B.json: the same command's result for the code before a change, run in the same
  call on the same machine (host speed differs a lot between lent machines), kept under
  "before"; --note: a line of context kept under "note".
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
from typing import Any

import torch

from gpu_backend.calibrate import meta
from gpu_backend.driver import ReplayResult, max_ok_error, replay
from gpu_backend.replay import FlashInferKernels
from gpu_backend.tracedata import TraceData, load_trace


def wall_pass(trace: TraceData, first: int, last: int) -> tuple[float, float, ReplayResult]:
    """(ms per step from `first` to `last`, ms per step the host waited for the device inside
    those steps, result) of one untimed replay. The wait is the time the host sat in
    FlashInfer-plan fences (the only waits in a step): wall - wait is the host's own time."""
    marks: dict[str, float] = {}
    k = FlashInferKernels(trace.model.num_q_heads, "cuda")

    def on_step(step: int, what: str) -> None:
        if (step, what) in ((first, "start"), (last, "done")):
            torch.cuda.synchronize()
            marks[what] = time.perf_counter()
            marks["wait_" + what] = k.wait_s

    res = replay(trace, k, "cuda", on_step=on_step)
    n = sum(1 for s in trace.steps if first <= s.step <= last and trace.rows[s.step])
    return ((marks["done"] - marks["start"]) * 1e3 / n,
            (marks["wait_done"] - marks["wait_start"]) * 1e3 / n, res)


def kernel_pass(trace: TraceData) -> list[float]:
    """Per generation step, the device ms of its append + attention launches."""
    k = FlashInferKernels(trace.model.num_q_heads, "cuda", timing=True)
    replay(trace, k, "cuda")
    return k.kernel_ms()[1:]


def profile_pass(trace: TraceData) -> None:
    prof = cProfile.Profile()
    prof.enable()
    replay(trace, FlashInferKernels(trace.model.num_q_heads, "cuda"), "cuda")
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(45)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile one more, untimed pass (host time)")
    ap.add_argument("--commit", default="",
                    help="commit to record (default: git rev-parse; the device copy has no .git)")
    ap.add_argument("--before", type=Path, help="this bench's JSON for the code before a change, "
                    "same call and machine")
    ap.add_argument("--note", default="", help="context to keep in the JSON")
    a = ap.parse_args()
    trace = load_trace(a.trace)
    first, last = trace.steps[1].step, trace.steps[-1].step
    replay(trace, FlashInferKernels(trace.model.num_q_heads, "cuda"), "cuda")  # JIT, warm-up
    wall, wait, res = wall_pass(trace, first, last)
    wall2, wait2, res2 = wall_pass(trace, first, last)
    ms = kernel_pass(trace)
    if a.profile:
        profile_pass(trace)
    kern = sum(ms) / len(ms)
    prep = res.prepare_s * 1e3 / max(len({r.step for r in res.rows}), 1)  # all steps
    rows = [r for r in res.rows if r.step >= first]
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip()
    out: dict[str, Any] = meta("python bench/gpu_replay.py " + " ".join(sys.argv[1:]))
    out |= {"commit": commit, "trace": str(a.trace), "steps": len(ms),
            "batch": len(trace.rows[first]),
            "kv_len_max": max(r.kv_len for r in trace.rows[last]), "wall_ms_per_step": wall,
            "host_wait_ms_per_step": wait,
            "kernel_ms_per_step": kern, "ratio": wall / kern, "prepare_ms_per_step": prep,
            "ratio_incl_prepare": (wall + prep) / kern, "counts": res.counts(),
            "max_ok_err": max_ok_error(res), "rows_checked": len(rows),
            "repeat": {"wall_ms_per_step": wall2, "host_wait_ms_per_step": wait2,
                       "ratio": wall2 / kern,
                       "same_verdicts": [r.verdict for r in res.rows] ==
                       [r.verdict for r in res2.rows]},
            "kernel_ms_min_max": [min(ms), max(ms)]}
    if a.before:
        out["before"] = _before(json.loads(a.before.read_text()))
    if a.note:
        out["note"] = a.note
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


def _before(b: dict[str, Any]) -> dict[str, Any]:
    return {"commit": b.get("commit"), "same_machine_and_call": True,
            "wall_ms_per_step": b["wall_ms_per_step"],
            "repeat_wall_ms_per_step": b["repeat"]["wall_ms_per_step"],
            "host_wait_ms_per_step": b.get("host_wait_ms_per_step"),
            "kernel_ms_per_step": b["kernel_ms_per_step"], "ratio": b["ratio"],
            "repeat_ratio": b["repeat"]["ratio"], "counts": b["counts"],
            "max_ok_err": b["max_ok_err"]}


if __name__ == "__main__":
    main()
