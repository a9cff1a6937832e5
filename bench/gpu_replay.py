"""Replay throughput on the GPU: wall time per step vs the kernels' own time (CUDA events).

python bench/gpu_replay.py TRACE_DIR [--json OUT] [--profile]   (TRACE_DIR: e.g.
tests/unit/replay_traces.py --big writes big_verify: batch 64, kv_len ~2k, MTP W=4, Llama-3.1-8B
heads)

Passes over the whole trace, each with fresh kernels (pass 0 JIT-compiles and warms up):
- wall (two passes, `wall_ms_per_step` and `repeat`): the whole replay step (content, truth,
  kernels, checksums, fp32 reference, per-token errors), from a device sync before the first
  generation step to one after the last, divided by the step count; no events, no spins. The
  first step (the prompts' prefill) is excluded, and so is the host preparation (`prepare`):
  these passes prepare every step before the first (the preparation drained before the
  replay starts: `prepare_in_wall_ms_per_step` is 0 and `ratio_excl_prepare` equals `ratio`),
  so `ratio` is the replay loop's own, comparable across changes.
- pipelined (one more pass, the replay's default): the steps are prepared in chunks one ahead
  (`staging.ramp`: the first ones small), the later chunks a step at a time between the timed
  steps (`pipelined.prepare_in_wall_ms_per_step`); `pipelined.ratio_end_to_end` = (its wall + the
  generation steps' preparation done before it) / kernels: what a user's replay of the
  generation steps costs, preparation included.
- whole (`whole`): what a user's replay costs, `flashinfer` on its default path from the call to its
  return: every step (the prompts' too) with everything inside it (the preparation, the
  pool's set-up) against every step's kernels, the median of 3 (`ratio`); `first_gen_ms`: from
  the call to the first generation step.
- kernels: each append and attention launch between CUDA events, after a GPU spin so the start
  event fires once the host has queued the launch: the kernels' device time, no host gaps (one
  pair of events around a whole step would count FlashInfer's plan() between its launches as
  kernel time).
- host_wait_ms_per_step: of the wall, the time the host waited for the device (the plan
  fences, `FlashInferKernels.wait_s`): near 0 means the host is the bottleneck, near the wall
  minus the host's own queueing time means the device is.
- --profile: a cProfile of one more pass, enabled for the generation steps only (host time by
  function; the prompt step and the preparation ahead of it are left out).
- --phases: one more pass with perf_counter_ns around each phase of the generation steps
  (events, content, append, plan, run, reference, errors, checksums, the loop between steps):
  host µs per step, inclusive (`phases_us_per_step`). The timers cost ~1 µs a phase.
- prepare: the host's numpy work per step from the trace (`gpu_backend.host.prepare`):
  `prepare_gen_ms_per_step` over the generation steps, and `ratio_gen_incl_prepare` = (wall +
  the generation steps' preparation done before the wall) / kernels: the end-to-end ratio when
  the whole preparation comes first (to compare with `pipelined.ratio_end_to_end`).
- --watch incremental|full: the replay's page watch (`gpu_backend/device/watch.py`; default
  incremental): full sums the whole pool every step, a third of a device-bound step.
- --device-time: one more pass under the torch profiler (CUDA activity only): device µs per
  generation step by kernel (`device_us_per_step`), where a device-bound replay's time goes.
- --sweep 64x2048,128x8192,...: the benchmark trace at each batch x kv_len, all of the above but
  the profile and phases (`sizes`): the ratio as the kernels get more work per step.
- --eager: every step launched eagerly; by default the steady steps run as CUDA graphs
  (`gpu_backend/device/graphs.py`; the kernels' own time is always measured eagerly, per launch).
- --steps N: the sweep trace's generation steps (default 12; a graph is captured in the first
  generation step of each wall pass, so its cost is inside the wall, spread over N steps).
- --before B.json: the same command's result for the code before a change, run in the same
  call on the same machine (host speed differs a lot between lent machines), kept under
  "before"; --note: a line of context kept under "note".
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from environment import host_speed

from gpu_backend.replay import loop
from gpu_backend.replay.flashinfer import FlashInferKernels
from gpu_backend.replay.loop import replay
from gpu_backend.tools.fidelity import meta
from gpu_backend.trace import TraceData, load_trace
from gpu_backend.verdicts import ReplayResult, max_ok_error

WATCH = ["incremental"]  # every pass's page watch (--watch)
GRAPHS = [True]  # steady steps as CUDA graphs (--eager: False)


def _kernels(trace: TraceData, timing: bool = False) -> FlashInferKernels:
    return FlashInferKernels(trace.model.num_q_heads, "cuda", timing=timing, graphs=GRAPHS[0])


def wall_pass(trace: TraceData, first: int, last: int, ahead: bool = True
              ) -> tuple[float, float, float, ReplayResult, float]:
    """(ms per step from `first` to `last`, ms per step the host waited for the device inside
    those steps, ms per step of host preparation inside them, result, ms the loop spent getting
    its prepared steps before `first`) of one untimed replay.
    The wait is the time the host sat in FlashInfer-plan fences (the only waits in a step):
    wall - wait is the host's own time. ahead: every step prepared before the replay starts;
    else as the replay prepares them (`prepare.prepared_steps`), one chunk ahead, the later
    steps between the timed ones. Preparation inside the timed steps is counted here."""
    marks: dict[str, float] = {}
    prep = {"on": 0.0, "s": 0.0, "pre": 0.0}
    k = _kernels(trace)
    real = loop.prepared_steps

    def timed_steps(*a: Any, **kw: Any) -> Any:
        if ahead:  # every step prepared before the replay starts
            t0 = time.perf_counter()
            every = list(real(*a, **kw))
            prep["pre"] += time.perf_counter() - t0
            yield from every
            return
        with contextlib.closing(real(*a, **kw)) as it:
            while True:
                t0 = time.perf_counter()
                p = next(it, None)
                dt = time.perf_counter() - t0
                prep["s"] += dt * prep["on"]
                prep["pre"] += dt * ("start" not in marks)
                if p is None:
                    return
                yield p

    def on_step(step: int, what: str) -> None:
        if (step, what) in ((first, "start"), (last, "done")):
            torch.cuda.synchronize()
            marks[what] = time.perf_counter()
            marks["wait_" + what] = k.wait_s
            prep["on"] = float(what == "start")

    loop.prepared_steps = timed_steps  # type: ignore[assignment]
    try:
        res = replay(trace, k, "cuda", on_step=on_step, watch=WATCH[0])
    finally:
        loop.prepared_steps = real  # type: ignore[assignment]
    n = sum(1 for s in trace.steps if first <= s.step <= last and trace.rows[s.step])
    return ((marks["done"] - marks["start"]) * 1e3 / n,
            (marks["wait_done"] - marks["wait_start"]) * 1e3 / n, prep["s"] * 1e3 / n, res,
            prep["pre"] * 1e3)


def kernel_pass(trace: TraceData) -> list[float]:
    """Per step, the prompts' first, the device ms of its append + attention launches."""
    k = _kernels(trace, timing=True)
    replay(trace, k, "cuda", watch=WATCH[0])
    return k.kernel_ms()


def whole_pass(trace: TraceData, first: int, kernel_ms: list[float], reps: int = 3
               ) -> dict[str, Any]:
    """What a user's replay costs: `flashinfer` on its default path, from the call to its return
    and a device sync, every step, the prompts' included, with everything inside (every
    step's preparation, the pool's set-up), against every step's kernels; the median of `reps`
    passes. `first_gen_ms`: from the call to the first generation step's start (the prompts'
    step and what the host does before and while it runs). `prepared_ahead`: the steps the
    loop's own preparation got ahead while it would have waited for the device (`loop.ReadySteps`),
    per pass. `host_ms`: `environment.host_speed` just before each pass (a slow host's pass
    shows there)."""
    walls, firsts, ahead, host = [], [], [], []
    marks: dict[str, float] = {}

    def on_step(step: int, what: str) -> None:
        if (step, what) == (first, "start"):
            marks["first"] = time.perf_counter()

    for _ in range(reps):
        host.append(host_speed())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = replay(trace, _kernels(trace), "cuda", on_step=on_step, watch=WATCH[0])
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
        firsts.append((marks["first"] - t0) * 1e3)
        ahead.append(res.stats.get("prepared_ahead", 0))
    wall, kern = sorted(walls)[len(walls) // 2], sum(kernel_ms)
    return {"wall_ms": wall, "wall_ms_all": walls, "first_gen_ms": sorted(firsts)[reps // 2],
            "kernel_ms": kern, "prompt_kernel_ms": kernel_ms[0], "ratio": wall / kern,
            "prepared_ahead": ahead, "host_ms": host}


def profile_pass(trace: TraceData, first: int, last: int) -> None:
    """cProfile of the generation steps only (from `first`'s start to `last`'s end)."""
    prof = cProfile.Profile()

    def on_step(step: int, what: str) -> None:
        if (step, what) == (first, "start"):
            prof.enable()
        elif (step, what) == (last, "done"):
            prof.disable()

    replay(trace, _kernels(trace), "cuda", on_step=on_step,
           watch=WATCH[0])
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(45)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)


# (module or class, attribute, phase name): the step's phases, each timed inclusive
_PHASES = [
    ("gpu_backend.replay.loop", "_apply_events", "events (poison, copies, resum)"),
    ("gpu_backend.replay.loop", "_content", "content (K/V/Q, truth)"),
    ("gpu_backend.replay.flashinfer:FlashInferKernels", "run_step", "run_step (all FlashInfer)"),
    ("flashinfer", "append_paged_kv_cache", "  append"),
    ("gpu_backend.replay.flashinfer:FlashInferKernels", "_plan", "  _plan (fence + plan)"),
    ("flashinfer:BatchPrefillWithPagedKVCacheWrapper", "plan", "    prefill plan()"),
    ("flashinfer:BatchDecodeWithPagedKVCacheWrapper", "plan", "    decode plan()"),
    ("flashinfer:BatchPrefillWithPagedKVCacheWrapper", "run", "  prefill run()"),
    ("flashinfer:BatchDecodeWithPagedKVCacheWrapper", "run", "  decode run()"),
    ("gpu_backend.device.graphs:StepGraphs", "run", "graph step (copy, replay, clone)"),
    ("gpu_backend.replay.loop", "reference", "reference"),
    ("gpu_backend.replay.loop", "token_errors", "token_errors"),
    ("gpu_backend.device.pool:KVPool", "sums_and_changes", "checksums (full watch)"),
    ("gpu_backend.device.pool:KVPool", "resum_pre", "events: resum_pre (incremental watch)"),
    ("gpu_backend.device.pool:KVPool", "post_check", "post_check (incremental watch)"),
    ("gpu_backend.device.pool:KVPool", "full_check", "full_check (incremental watch)"),
]


def phases_pass(trace: TraceData, first: int, last: int) -> dict[str, float]:
    """Host µs per generation step in each phase (inclusive), by perf_counter_ns wrappers."""
    import functools
    import importlib

    tot: dict[str, int] = {}
    on = [False]
    saved = []

    def wrap(fn: Any, name: str) -> Any:
        @functools.wraps(fn)
        def w(*a: Any, **kw: Any) -> Any:
            if not on[0]:
                return fn(*a, **kw)
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                tot[name] = tot.get(name, 0) + time.perf_counter_ns() - t0
        return w

    for where, attr, name in _PHASES:
        mod, _, cls = where.partition(":")
        try:
            obj = importlib.import_module(mod)
            obj = getattr(obj, cls) if cls else obj
            fn = getattr(obj, attr)
        except (ImportError, AttributeError):
            continue
        saved.append((obj, attr, obj.__dict__[attr] if attr in obj.__dict__ else fn))
        setattr(obj, attr, wrap(fn, name))
    marks: dict[str, int] = {}

    def on_step(step: int, what: str) -> None:
        t = time.perf_counter_ns()
        if (step, what) == (first, "start"):
            torch.cuda.synchronize()
            on[0] = True
            marks["t0"] = marks["prev"] = time.perf_counter_ns()
            return
        if not on[0]:
            return
        key = "step body (start..done)" if what == "done" else "between steps (loop, flush)"
        tot[key] = tot.get(key, 0) + t - marks["prev"]
        marks["prev"] = time.perf_counter_ns()
        if (step, what) == (last, "done"):
            on[0] = False
            torch.cuda.synchronize()
            tot["wall incl. final sync"] = time.perf_counter_ns() - marks["t0"]

    try:
        replay(trace, _kernels(trace), "cuda",
               on_step=on_step, watch=WATCH[0])
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
    n = sum(1 for s in trace.steps if first <= s.step <= last and trace.rows[s.step])
    out = {k: v / 1e3 / n for k, v in tot.items()}
    for k, v in out.items():
        print(f"phase {k:40s} {v:9.1f} us/step")
    return out


def device_pass(trace: TraceData, first: int, last: int) -> dict[str, float]:
    """Device µs per generation step by kernel (torch profiler, CUDA activity only), from
    `first`'s start to `last`'s end: what each part of the full verdicts costs the device when
    the replay is device-bound. "busy" is their sum; each name is cut to 60 characters."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])

    def on_step(step: int, what: str) -> None:
        if (step, what) in ((first, "start"), (last, "done")):
            torch.cuda.synchronize()
            if what == "start":
                prof.start()
            else:
                prof.stop()

    replay(trace, _kernels(trace), "cuda", on_step=on_step,
           watch=WATCH[0])
    n = sum(1 for s in trace.steps if first <= s.step <= last and trace.rows[s.step])
    tot: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        t = e.self_cuda_time_total if t is None else t
        if t > 0:
            tot[e.key[:60]] = tot.get(e.key[:60], 0.0) + t / n
    out = dict(sorted(tot.items(), key=lambda kv: -kv[1]))
    out["busy"] = sum(tot.values())
    for k, v in out.items():
        print(f"device {k:60s} {v:9.1f} us/step")
    return out


def measure(path: Path, phases: bool = False, profile: bool = False,
            device: bool = False) -> dict[str, Any]:
    """Every pass over one trace (module docstring); the figures of one result."""
    trace = load_trace(path)
    first, last = trace.steps[1].step, trace.steps[-1].step
    replay(trace, _kernels(trace), "cuda",
           watch=WATCH[0])  # JIT, warm-up
    wall, wait, pin, res, _ = wall_pass(trace, first, last)
    wall2, wait2, pin2, res2, _ = wall_pass(trace, first, last)
    wall_p, _, pin_p, res_p, _ = wall_pass(trace, first, last, ahead=False)
    ms_all = kernel_pass(trace)
    ms = ms_all[1:]
    whole = whole_pass(trace, first, ms_all)
    ph = phases_pass(trace, first, last) if phases else None
    dev = device_pass(trace, first, last) if device else None
    if profile:
        profile_pass(trace, first, last)
    kern = sum(ms) / len(ms)
    prep = res.prepare_s * 1e3 / max(len({r.step for r in res.rows}), 1)  # all steps
    gen = [v for k, v in res.prepare_step_s.items() if k >= first]
    prep_gen = sum(gen) * 1e3 / max(len(gen), 1)
    gen_p = [v for k, v in res_p.prepare_step_s.items() if k >= first]
    before_p = max(sum(gen_p) * 1e3 / max(len(gen_p), 1) - pin_p, 0.0)  # ahead of the wall
    rows = [r for r in res.rows if r.step >= first]
    out = {"trace": str(path), "steps": len(ms), "batch": len(trace.rows[first]),
           "kv_len_max": max(r.kv_len for r in trace.rows[last]), "wall_ms_per_step": wall,
           "host_wait_ms_per_step": wait,
           "kernel_ms_per_step": kern, "ratio": wall / kern,
           "prepare_in_wall_ms_per_step": pin, "ratio_excl_prepare": (wall - pin) / kern,
           "prepare_ms_per_step": prep,
           "prepare_gen_ms_per_step": prep_gen,
           "ratio_gen_incl_prepare": (wall + max(prep_gen - pin, 0.0)) / kern,
           "pipelined": {"wall_ms_per_step": wall_p, "prepare_in_wall_ms_per_step": pin_p,
                         "prepare_gen_ms_per_step": before_p + pin_p,
                         "ratio_end_to_end": (wall_p + before_p) / kern,
                         "same_verdicts": [r.verdict for r in res.rows] ==
                         [r.verdict for r in res_p.rows]},
           "counts": res.counts(),
           "max_ok_err": max_ok_error(res), "rows_checked": len(rows), "watch_used": res.watch,
           "graphs": {k: v for k, v in res.stats.items()
                      if "graph" in k or "eager" in k or k == "plan_mismatches"},
           "repeat": {"wall_ms_per_step": wall2, "host_wait_ms_per_step": wait2,
                      "ratio": wall2 / kern, "prepare_in_wall_ms_per_step": pin2,
                      "ratio_excl_prepare": (wall2 - pin2) / kern,
                      "same_verdicts": [r.verdict for r in res.rows] ==
                      [r.verdict for r in res2.rows]},
           "kernel_ms_min_max": [min(ms), max(ms)], "whole": whole}
    if ph is not None:
        out["phases_us_per_step"] = ph
    if dev is not None:
        out["device_us_per_step"] = dev
    return out


def sweep(sizes: str, work: Path, device: bool = False, steps: int = 12
          ) -> list[dict[str, Any]]:
    """The benchmark trace at each BATCHxKV of `sizes` (e.g. 64x2048,128x8192), one at a time:
    how the wall/kernel ratio moves as the kernels get more work per step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
    from replay_traces import big_verify

    out = []
    for size in sizes.split(","):
        batch, kv = (int(x) for x in size.lower().split("x"))
        path = big_verify(work / f"big_{batch}x{kv}", batch=batch, kv=kv, steps=steps)
        r = measure(path, device=device)
        print(f"batch {batch:4d} kv {kv:6d}: wall {r['wall_ms_per_step']:.3f} ms/step, kernels "
              f"{r['kernel_ms_per_step']:.3f}, ratio {r['ratio']:.2f}x "
              f"(repeat {r['repeat']['ratio']:.2f}x), end to end with preparation "
              f"{r['pipelined']['ratio_end_to_end']:.2f}x pipelined, "
              f"{r['ratio_gen_incl_prepare']:.2f}x all ahead"
              + f"; whole replay {r['whole']['wall_ms']:.1f} ms "
              f"against {r['whole']['kernel_ms']:.1f} of kernels ({r['whole']['ratio']:.2f}x), "
              f"{r['counts']}", flush=True)
        out.append({"batch": batch, "kv": kv} | r)
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, nargs="?",
                    help="trace directory (tests/unit/replay_traces.py --big writes big_verify)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile one more, untimed pass (host time)")
    ap.add_argument("--phases", action="store_true",
                    help="one more pass: host µs per generation step by phase")
    ap.add_argument("--watch", choices=("incremental", "full"), default="incremental",
                    help="the replay's page watch (gpu_backend/device/watch.py)")
    ap.add_argument("--eager", action="store_true",
                    help="every step launched eagerly, no CUDA graphs "
                    "(gpu_backend/device/graphs.py)")
    ap.add_argument("--steps", type=int, default=12,
                    help="--sweep: generation steps of the benchmark trace (default 12)")
    ap.add_argument("--device-time", action="store_true",
                    help="one more pass: device µs per generation step by kernel (torch profiler)")
    ap.add_argument("--sweep", metavar="BxKV,...",
                    help="instead of TRACE: the benchmark trace at each batch x kv_len, written "
                    "under --work (e.g. 64x2048,128x8192)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvsim-gpu-sweep"),
                    help="where --sweep writes its traces")
    ap.add_argument("--commit", default="",
                    help="commit to record (default: git rev-parse; the device copy has no .git)")
    ap.add_argument("--before", type=Path, help="this bench's JSON for the code before a change, "
                    "same call and machine")
    ap.add_argument("--note", default="", help="context to keep in the JSON")
    a = ap.parse_args()
    if (a.trace is None) == (a.sweep is None):
        ap.error("give a TRACE directory or --sweep, not both")
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True).stdout.strip()
    WATCH[0] = a.watch
    GRAPHS[0] = not a.eager
    out: dict[str, Any] = meta("python bench/gpu_replay.py " + " ".join(sys.argv[1:]))
    out["commit"], out["watch"], out["graphs"] = commit, a.watch, not a.eager
    if a.sweep:
        out["sizes"] = sweep(a.sweep, a.work, a.device_time, a.steps)
    else:
        out |= measure(a.trace, a.phases, a.profile, a.device_time)
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
