"""Simulator throughput benchmark (performance issue): `make bench` or `python bench/run.py`.

Each configuration runs in a fresh process (no warm caches shared between them) after one
warm-up run, `--reps` times; medians are reported. Writes bench/results/sim.json.

    workload (a) = bench/workloads/a_vidur.toml   (Vidur comparison: vLLM, no MTP, no reuse)
    workload (b) = bench/workloads/b_mtp.toml     (MTP + overlap + reuse)
    modes: no-trace | trace (pages etc. written) | checked (every invariant, online, no trace)
           | trace+checked (both)

The loop's CPU time (process_time) is reported next to wall time: these 2-core machines are
shared, and CPU time is what a quiet machine's wall time would be.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from environment import environment

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"a": "bench/workloads/a_vidur.toml", "b": "bench/workloads/b_mtp.toml"}
# mode -> (trace written, every invariant checked)
MODES = {"no-trace": (False, False), "trace": (True, False), "checked": (False, True),
         "trace+checked": (True, True)}

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from sim.api import load_scenario, run
sc, base = load_scenario(sys.argv[1])
wl = sc.workload.model_copy(update={"synthetic": sc.workload.synthetic.model_copy(
    update={"num_requests": int(sys.argv[2])})})
sc = sc.model_copy(update={"workload": wl})
out = sys.argv[3] if sys.argv[3] != "-" else None
t1, c1 = time.perf_counter(), time.process_time()
res = run(sc, out=out, check=sys.argv[4] == "1", base_dir=base, collect=False,
          engine=sys.argv[5])
t2, c2 = time.perf_counter(), time.process_time()
s = res.summary
print(json.dumps({"loop_s": t2 - t1, "loop_cpu_s": c2 - c1, "process_s": t2 - t0,
                  "process_cpu_s": c2, "steps": s["steps"],
                  "requests": s["requests"], "violations": s["violations"],
                  "engine": s["engine"],
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def once(wl: str, mode: str, n: int, tmp: Path, engine: str) -> dict:
    trace, check = MODES[mode]
    out = str(tmp / f"{wl}-{mode}") if trace else "-"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", CHILD, WORKLOADS[wl], str(n), out,
                          "1" if check else "0", engine],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    d = json.loads(res.stdout.strip().splitlines()[-1])
    d["wall_s"] = time.perf_counter() - t0
    return d


def median_of(runs: list[dict]) -> dict:
    m = {k: statistics.median(r[k] for r in runs) for k in (
        "loop_s", "loop_cpu_s", "process_s", "process_cpu_s", "wall_s", "peak_rss_mb")}
    r0 = runs[0]
    m.update(steps=r0["steps"], requests=r0["requests"], violations=r0["violations"],
             engine=r0["engine"],
             req_per_s=r0["requests"] / m["loop_s"], steps_per_s=r0["steps"] / m["loop_s"],
             req_per_cpu_s=r0["requests"] / m["loop_cpu_s"],
             reps=len(runs))
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workloads", default="ab")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--engines", default="auto",
                    help="auto,reference: each workload under each engine, side by side")
    ap.add_argument("--reps-for", default="",
                    help="per-mode repetitions, e.g. checked=1 (long runs)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sim.json")
    args = ap.parse_args()
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad or any(w not in WORKLOADS for w in args.workloads):
        ap.error(f"unknown mode {bad} (modes: {', '.join(MODES)}) or workload in "
                 f"{args.workloads!r} (workloads: {''.join(WORKLOADS)})")
    import tempfile
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        reps_for = dict(kv.split("=") for kv in args.reps_for.split(",") if kv)
        for wl in args.workloads:
            for engine in args.engines.split(","):
                for mode in args.modes.split(","):
                    key = f"{wl}/{engine}/{mode}"
                    once(wl, mode, min(args.requests, 200), tmp, engine)  # warm-up (JIT cache)
                    reps = int(reps_for.get(mode, args.reps))
                    r = results[key] = median_of(
                        [once(wl, mode, args.requests, tmp, engine) for _ in range(reps)])
                    print(f"{key:22s} ({r['engine']}) {r['requests']} req {r['steps']} steps: loop "
                          f"{r['loop_s']:.1f} s wall / {r['loop_cpu_s']:.1f} s CPU "
                          f"({r['req_per_cpu_s']:.0f} req per CPU-s), process "
                          f"{r['process_s']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB",
                          flush=True)
    meta = environment() | {"requests": args.requests, "reps": args.reps,
                            "engines": args.engines}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
