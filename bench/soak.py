"""Soak: a million checked steps over the fixed profiles under memory pressure, flat memory.

    .venv/bin/python bench/soak.py --steps 1000000 --out bench/results/soak.json

Profiles × capacity policies run round-robin in chunks (one `sim.api.run` of a fresh seed each,
invariants checked online on every step) until the total reaches --steps. The pool is small so
admission waits (guaranteed-no-evict) and max-utilization must preempt; MTP, overlap and prefix
reuse are all on. RSS is sampled every 2048 steps (the progress callback) and after each chunk;
"growth" compares the end of the first chunk with the second half of the chunks, so the
per-run in-memory tables (which grow within one run, by design) do not count as a leak.

A violation or a hang (no progress for --stall seconds: a step that never finishes) is a
modeling bug: the scenario, seed and first message are saved in the results, and that
configuration is dropped from the rest of the soak.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.api import parse_scenario, run

CONFIGS = (("trtllm-post-17264", "guaranteed-no-evict"),
           ("trtllm-post-17264", "max-utilization"),
           ("vllm-v1-legacy", "guaranteed-no-evict"))
_PAGE = os.sysconf("SC_PAGE_SIZE")


def scenario(profile: str, policy: str, seed: int, num_requests: int) -> dict[str, Any]:
    """A pool of 96 blocks × 16 tokens (1536 slots) for prompts up to 512 + 256 outputs at
    200 QPS: the queue never drains, so admission waits and max-utilization must preempt."""
    return {
        "seed": seed, "profile": profile,
        "model": {"max_position_embeddings": 1024},
        "cache": {"tokens_per_block": 16, "num_blocks": 96, "reuse": "partial-copy"},
        "scheduler": {"max_batch_size": 16, "max_num_tokens": 1024, "policy": policy,
                      "chunk_size": 256},
        "spec": {"mode": "mtp", "max_draft_len": 3,
                 "acceptance": {"kind": "rates", "rates": [0.8, 0.6, 0.4]}},
        "overlap": {"enabled": True},
        "limits": {"max_seq_len": 1024},
        "workload": {"synthetic": {
            "num_requests": num_requests, "arrival": "poisson", "qps": 200.0,
            "prompt_len": {"kind": "uniform", "min": 16, "max": 512},
            "output_len": {"kind": "uniform", "min": 8, "max": 256},
            "shared_prefix": {"groups": 4, "prefix_len": 128, "fraction": 0.7}}},
    }


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


class Stalled(Exception):
    """No progress callback for too long: the engine is stuck inside one step."""


@dataclass
class Soak:
    stall_s: float
    steps: int = 0
    violations: int = 0
    chunks: list[dict[str, Any]] = field(default_factory=list)
    samples: list[tuple[int, float]] = field(default_factory=list)  # (total steps, RSS MB)
    findings: list[dict[str, Any]] = field(default_factory=list)

    def _progress(self, k: int) -> None:
        signal.setitimer(signal.ITIMER_REAL, self.stall_s)
        self.samples.append((self.steps + k, round(rss_mb(), 1)))

    def chunk(self, profile: str, policy: str, seed: int, num_requests: int) -> bool:
        """One run; False when it found a modeling bug (recorded in findings)."""
        sc_dict = scenario(profile, policy, seed, num_requests)
        sc = parse_scenario(sc_dict, "soak")
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, self.stall_s)
        try:
            res = run(sc, check=True, on_progress=self._progress)
        except Stalled:
            self._finding("hang", profile, policy, sc_dict,
                          f"no step finished for {self.stall_s:.0f} s after total step "
                          f"{self.samples[-1][0] if self.samples else 0}",
                          traceback.format_exc(limit=-6))
            return False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        gc.collect()
        s = res.summary
        self.steps += s["steps"]
        self.violations += len(res.violations)
        self.samples.append((self.steps, round(rss_mb(), 1)))
        self.chunks.append({"profile": profile, "policy": policy, "seed": seed,
                            "steps": s["steps"], "violations": len(res.violations),
                            "preemptions": s["preemptions"], "finished": s["finished"],
                            "peak_kv_blocks": s["peak_kv_blocks"],
                            "seconds": round(time.perf_counter() - t0, 2),
                            "rss_mb_after": self.samples[-1][1]})
        if res.violations:
            self._finding("violation", profile, policy, sc_dict, res.violations[0].message, "")
            return False
        return True

    def _finding(self, kind: str, profile: str, policy: str, sc: dict, msg: str,
                 where: str) -> None:
        self.findings.append({"kind": kind, "profile": profile, "policy": policy,
                              "seed": sc["seed"], "message": msg, "stack": where,
                              "scenario": sc})
        print(f"FINDING {kind} {profile}/{policy} seed {sc['seed']}: {msg}", flush=True)


def _on_alarm(signum: int, frame: object) -> None:
    raise Stalled


def rss_summary(soak: Soak) -> dict[str, Any]:
    ends = [c["rss_mb_after"] for c in soak.chunks]
    if not ends:
        return {}
    second = ends[len(ends) // 2:]
    rss = [r for _, r in soak.samples]
    return {"first_chunk_end_mb": ends[0], "second_half_max_mb": max(second),
            "second_half_min_mb": min(second), "growth_mb": round(max(second) - ends[0], 1),
            "peak_mb": max(rss), "samples": len(soak.samples),
            "curve": soak.samples[:: max(1, len(soak.samples) // 40)]}


def write_report(soak: Soak, out: Path, wall: float) -> dict[str, Any]:
    by_cfg = {f"{p}/{c}": sum(x["steps"] for x in soak.chunks
                              if (x["profile"], x["policy"]) == (p, c)) for p, c in CONFIGS}
    report = {"command": " ".join([".venv/bin/python", *sys.argv]), "steps": soak.steps,
              "steps_by_config": by_cfg, "violations": soak.violations,
              "preemptions": sum(c["preemptions"] for c in soak.chunks),
              "wall_s": round(wall, 1), "steps_per_s": round(soak.steps / max(wall, 1e-9), 1),
              "rss": rss_summary(soak), "findings": soak.findings, "chunks": soak.chunks}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000, help="checked steps in total")
    ap.add_argument("--requests", type=int, default=1000, help="requests per chunk (one run)")
    ap.add_argument("--stall", type=float, default=60.0, help="seconds without progress = hang")
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGALRM, _on_alarm)
    soak = Soak(args.stall)
    live = list(CONFIGS)
    seed, t0 = 0, time.perf_counter()
    while soak.steps < args.steps and live:
        for cfg in list(live):
            if not soak.chunk(*cfg, seed, args.requests):
                live.remove(cfg)
            print(f"{soak.steps} steps, {time.perf_counter() - t0:.0f} s, RSS {rss_mb():.0f} MB",
                  flush=True)
        seed += 1
        write_report(soak, args.out, time.perf_counter() - t0)  # partial results survive a kill
    report = write_report(soak, args.out, time.perf_counter() - t0)
    print(json.dumps({k: v for k, v in report.items() if k not in ("chunks",)}, indent=1)[:4000])
    return 0 if not soak.findings else 1


if __name__ == "__main__":
    sys.exit(main())
