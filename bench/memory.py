"""Peak memory of a long run with the trace written (performance issue: 1,000,000 requests with
the trace on in < 2 GB peak RSS). `make bench-memory` runs:
    python bench/memory.py --requests 1000000 --scenario bench/workloads/a_vidur.toml \
        --out bench/results/memory_1m.json

Nothing per step or per request is kept in memory (`collect=False`): the workload is generated
lazily, finished requests leave the engine, and the trace streams to Parquet in record batches.
RSS is sampled every 2,048 steps so a leak shows as a slope, not just a peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

from environment import environment

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--scenario", default="bench/workloads/b_mtp.toml")
    ap.add_argument("--check", action="store_true", help="also check every invariant")
    ap.add_argument("--engine", default="auto", help="auto | fast | reference (sim.api.run)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory.json")
    args = ap.parse_args()
    from sim.api import load_scenario, run

    sc, base = load_scenario(ROOT / args.scenario)
    syn = sc.workload.synthetic
    assert syn is not None, "the memory benchmark needs a synthetic workload"
    wl = sc.workload.model_copy(update={"synthetic": syn.model_copy(
        update={"num_requests": args.requests})})
    sc = sc.model_copy(update={"workload": wl})
    curve: list[tuple[int, float]] = []
    tmp = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    try:
        res = run(sc, out=tmp / "trace", check=args.check, base_dir=base, collect=False,
                  on_progress=lambda k: curve.append((k, rss_mb())), engine=args.engine)
        size = sum(f.stat().st_size for f in (tmp / "trace").iterdir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    half = curve[len(curve) // 2:] if curve else [(0, 0.0)]
    out = environment() | {
           "scenario": args.scenario, "requests": args.requests, "check": args.check,
           "engine": res.summary["engine"],
           "steps": res.summary["steps"], "violations": res.summary["violations"],
           "wall_s": round(wall, 1), "peak_rss_mb": round(peak, 1),
           "trace_mb": round(size / 2**20, 1),
           "rss_second_half_mb": [round(half[0][1], 1), round(half[-1][1], 1)],
           "rss_curve": [(k, round(m, 1)) for k, m in curve[:: max(1, len(curve) // 50)]]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "rss_curve"}))


if __name__ == "__main__":
    main()
