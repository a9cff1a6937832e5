"""One grid point, run in a worker process (spawn-safe: plain dicts in, plain dicts out).

Without a search a point is one simulation. With one, it bisects the searched parameter (QPS) in
log space: the SLO holds at `lo` and fails at `hi` after the ends are tried, and every run is
cached by content, so a resumed sweep replays a search from the cache.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sim.sweep.cache import ResultCache, content_key, file_digest
from sim.sweep.spec import Search, Slo, set_path

if TYPE_CHECKING:
    from sim.config import Scenario


@dataclass
class PointTask:
    index: int
    scenario: dict
    base_dir: str
    cache_dir: str
    version: str
    slo: dict
    search: dict | None = None
    values: dict[str, Any] = field(default_factory=dict)


def simulate(sc: Scenario, base_dir: str, slo: Slo) -> dict:
    """Run one scenario and return its metrics (+ summary counts). An SLO on ITL needs the rows
    table, which only a trace keeps: such a run writes one to a temporary folder."""
    from sim.api import run
    from sim.metrics import compute_metrics, trace_metrics

    targets = slo.targets()
    if any(t.metric == "itl" for t in targets):
        with tempfile.TemporaryDirectory(prefix="kvsim-sweep-") as tmp:
            res = run(sc, out=Path(tmp) / "trace", check=False, base_dir=Path(base_dir),
                      collect=False)
            m = trace_metrics(Path(tmp) / "trace", targets)
    else:
        res = run(sc, check=False, base_dir=Path(base_dir))
        m = compute_metrics(res.requests, res.steps, res.kv_series,
                            num_blocks=int(res.summary["num_blocks"]),
                            slo=targets)
    return dict(m) | {"sim_time_s": res.summary["sim_time_ns"] / 1e9,
                      "steps": res.summary["steps"], "violations": res.summary["violations"]}


def input_digests(sc: Scenario, base_dir: Path) -> dict[str, str]:
    """The files a scenario reads, by role: the workload trace (resolved as the run resolves
    it) and the calibration table."""
    from sim.workload.traces import resolve_trace

    out = {}
    trace = sc.workload.trace
    if trace is not None and (file := resolve_trace(trace.path, base_dir)) is not None:
        out["workload.trace"] = file_digest(file)
    if sc.cost.calibration:
        path = Path(sc.cost.calibration)
        out["cost.calibration"] = file_digest(path if path.is_absolute() else base_dir / path)
    return out


class _Runner:
    def __init__(self, task: PointTask) -> None:
        self.task, self.cache = task, ResultCache(task.cache_dir)
        self.slo = Slo.model_validate(task.slo)
        self.computed = self.cached = 0

    def metrics(self, scenario: dict) -> dict:
        from sim.api import parse_scenario

        sc = parse_scenario(scenario)
        # the SLO is part of the key: goodput and attainment are computed under it
        key = content_key(sc.model_dump(mode="json"), f"{self.task.version} slo={self.slo}",
                          self.task.base_dir, input_digests(sc, Path(self.task.base_dir)))
        hit = self.cache.get(key)
        if hit is not None:
            self.cached += 1
            return hit
        m = simulate(sc, self.task.base_dir, self.slo)
        self.cache.put(key, m)
        self.computed += 1
        return m

    def meets(self, m: dict) -> bool:
        if m["finished"] < m["requests"]:  # rejected or unfinished requests: overloaded
            return False
        return all(t.met(m) for t in self.slo.targets())

    def at(self, search: Search, value: float) -> tuple[bool, dict]:
        sc = _copy(self.task.scenario)
        set_path(sc, search.param, value, "sweep")
        m = self.metrics(sc)
        return self.meets(m), m

    def search(self, search: Search) -> dict:
        lo, hi = search.lo, search.hi
        ok_hi, m_hi = self.at(search, hi)
        if ok_hi:
            return {"max_qps": hi, "search_capped": True} | m_hi
        ok_lo, best = self.at(search, lo)
        if not ok_lo:
            return {"max_qps": 0.0, "search_capped": False} | best
        for _ in range(search.iters):
            mid = round(math.sqrt(lo * hi), 6)
            ok, m = self.at(search, mid)
            if ok:
                lo, best = mid, m
            else:
                hi = mid
        return {"max_qps": lo, "search_capped": False} | best


def _copy(d: dict) -> dict:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def run_point(task: PointTask) -> dict:
    """Metrics of one grid point; `_computed` / `_cached` count the simulations behind it."""
    r = _Runner(task)
    if task.search is None:
        out = r.metrics(task.scenario)
    else:
        out = r.search(Search.model_validate(task.search))
    return dict(out) | {"_computed": r.computed, "_cached": r.cached}
