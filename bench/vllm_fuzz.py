"""Workloads diffed per minute: `kvsim fuzz --engine vllm`'s search pass, timed.

N hypothesis workloads (seed S) run through vLLM 0.33.0's real scheduler (one driver process,
.venv-vllm) and kvsim's vllm-v1 profile; each is recorded, checked and diffed over every step,
as the campaign does, without shrinking. Writes bench/results/vllm_fuzz.json: the driver's
start-up, the workloads per minute after it and with it, and what the workloads found.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from environment import environment, positive  # noqa: E402

from sim.engines.vllm import PINNED  # noqa: E402
from sim.fuzz.vllm_campaign import Tally, VllmCampaign  # noqa: E402
from sim.fuzz.vllm_report import counts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=positive, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/vllm_fuzz.json")
    a = ap.parse_args()
    load_before = os.getloadavg()
    first: list[float] = []
    shown = [0.0]

    def progress(t: Tally) -> None:
        if t.workloads and not first:  # the first workload's time holds vLLM's imports
            first.append(t.elapsed)
        if t.elapsed >= shown[0]:
            shown[0] = t.elapsed + 30
            print(f"{t.workloads} workloads, {t.elapsed:.0f} s", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    tally, _ = VllmCampaign(seed=a.seed, examples=a.examples, shrink=False).run(progress)
    wall = time.monotonic() - t0
    searched = tally.elapsed - (first[0] if first else 0.0)
    result = {"environment": environment() | {"cores_used": 2, "vllm": PINNED,
                                              "load_avg_before": [round(x, 2)
                                                                  for x in load_before]},
              "examples": a.examples, "seed": a.seed,
              "first_workload_s": round(first[0], 2) if first else None,
              "wall_s": round(wall, 2),
              "workloads_per_min": round(60 * tally.workloads / wall, 1),
              "workloads_per_min_after_start": round(60 * (tally.workloads - 1) / searched, 1)
              if searched > 0 else None,
              "found": counts(tally)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=2))


if __name__ == "__main__":
    main()
