"""`diff`: the real vLLM against kvsim's `vllm-v1` profile, step by step, from their traces.

Both runs are written as traces (the real engine by `record`, the profile by `sim.api.run`)
and compared per step in a fixed order of fields; the first that differs is where the
profile stops being vLLM. Each field is read from the trace alone:

    scheduled     the step's (request, query tokens), sorted
    prefix_hit    per admission (a request's first row, or a row that does not continue its
                  previous one: a preempted request's re-admission), the tokens it starts at
    preempted     requests freed after step k-1 that still run later (scheduling of step k)
    block_tables  each row's blocks
    free          (blocks_free, blocks_cached) after scheduling
    finished      requests whose last row is this step's and which finished
    accepted      each generation row's accepted drafts
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from sim.config import Scenario
from sim.engines.record import record
from sim.trace.reader import read_trace

FIELDS = ("scheduled", "prefix_hit", "preempted", "block_tables", "free", "finished",
          "accepted")


@dataclass
class Divergence:
    step: int
    field: str
    kvsim: object
    vllm: object


@dataclass
class DiffResult:
    steps: tuple[int, int]  # (kvsim's, vLLM's)
    first: Divergence | None
    tally: dict[str, int] = field(default_factory=dict)  # field -> steps where it differs
    first_by_field: dict[str, int] = field(default_factory=dict)


def diff(sc: Scenario, base_dir: Path | None = None, every: bool = False,
         where: str = "scenario") -> DiffResult:
    """Run `sc` through both engines and compare. `every`: tally every step, not stop at the
    first divergence. `sc` must already pass `refuse_unsupported`."""
    from sim.api import run

    with tempfile.TemporaryDirectory(prefix="kvsim-diff-") as tmp:
        run(sc, out=Path(tmp) / "kvsim", check=False, profile="vllm-v1", base_dir=base_dir,
            collect=False)
        record(sc, Path(tmp) / "vllm", base_dir, where)
        ours, real = per_step(Path(tmp) / "kvsim"), per_step(Path(tmp) / "vllm")
    return compare(ours, real, every)


def compare(ours: list[dict], real: list[dict], every: bool) -> DiffResult:
    res = DiffResult((len(ours), len(real)), None)
    empty = dict.fromkeys(FIELDS)
    for k in range(max(len(ours), len(real))):
        a = ours[k] if k < len(ours) else empty
        b = real[k] if k < len(real) else empty
        for f in FIELDS:
            if a[f] == b[f]:
                continue
            if res.first is None:
                res.first = Divergence(k, f, a[f], b[f])
            res.tally[f] = res.tally.get(f, 0) + 1
            res.first_by_field.setdefault(f, k)
        if res.first is not None and not every:
            break
    return res


def per_step(trace_dir: Path) -> list[dict]:
    """The compared fields of every step of a trace (see the module docstring)."""
    t = read_trace(trace_dir).tables
    steps = t["steps"].to_pylist()
    rows = t["rows"].to_pylist()
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_step[r["step"]].append(r)
    last_row = {r["request"]: r["step"] for r in rows}
    done = {r["request"] for r in t["requests"].to_pylist()
            if r["finish_reason"] in ("length", "max_seq_len")}
    freed: dict[int, set[int]] = defaultdict(set)  # tag step -> requests freed
    for e in t["blocks"].to_pylist():
        if e["event"] == "free":
            freed[e["step"]].add(e["request"])
    hits = _admissions(rows)
    out = []
    for s in steps:
        k, here = s["step"], by_step.get(s["step"], [])
        out.append({
            "scheduled": sorted((r["request"], r["q_len"]) for r in here),
            "prefix_hit": hits.get(k, {}),
            "preempted": sorted(r for r in freed.get(k - 1, ()) if last_row.get(r, -1) >= k),
            "block_tables": {r["request"]: list(r["alloc"]) for r in here},
            "free": (s["blocks_free"], s["blocks_cached"]),
            "finished": sorted(r["request"] for r in here
                               if last_row[r["request"]] == k and r["request"] in done),
            "accepted": {r["request"]: r["accepted"] for r in here if r["phase"] == "gen"},
        })
    return out


def _admissions(rows: list[dict]) -> dict[int, dict[int, int]]:
    """step -> {request: tokens it starts at} for rows that start an admission."""
    out: dict[int, dict[int, int]] = defaultdict(dict)
    nxt: dict[int, int] = {}  # request -> where its next row continues
    for r in rows:
        req = r["request"]
        if r["phase"] == "ctx" and nxt.get(req) != r["committed"]:
            out[r["step"]][req] = r["committed"]
        nxt[req] = r["committed"] + r["new_tokens"]
    return out
