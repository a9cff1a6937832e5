"""The sweep file: a base scenario, a grid of dotted field paths → values, an optional search.

    base = "llama8b_h200_base.toml"          # relative to this file
    [slo]                                    # the search's pass criterion, and goodput
    ttft_p99_ms = 500                        # <metric>_<stat>_ms: ttft, tpot, itl, e2e ×
    tpot_p99_ms = 10                         #   mean, p50, p90, p99 (sim/slo.py)
    [grid]
    "spec.max_draft_len" = [1, 2, 3]
    "overlap.enabled" = [true, false]
    [search]                                 # max QPS under the SLO, per grid point
    param = "workload.synthetic.qps"
    lo = 1.0
    hi = 64.0
    iters = 6
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, model_validator

from sim.errors import ScenarioError
from sim.inputs import MAX_DEPTH, load_toml, shown
from sim.numbers import Float, Int
from sim.slo import Target, check_bound, split_key, targets

_STRICT = ConfigDict(extra="forbid", frozen=True)
MAX_GRID_POINTS = 4096
MAX_SWEEP_BYTES = 2**20


class Slo(RootModel[dict[str, Any]]):
    """`[slo]`: `<metric>_<stat>_ms = bound` (sim/slo.py), e.g. `ttft_p99_ms = 500`,
    `itl_mean_ms = 15`; every one must hold for a run to pass."""

    model_config = ConfigDict(frozen=True)
    root: dict[str, Any] = {}

    @model_validator(mode="after")
    def _keys(self) -> Slo:
        for k, v in self.root.items():
            try:
                split_key(k)
                check_bound(v)
            except ValueError as e:
                raise ValueError(f"slo.{k}: {e}") from None
        return self

    def targets(self) -> list[Target]:
        return targets(self.root)

    def __str__(self) -> str:
        return ", ".join(map(str, self.targets())) or "no SLO"


class Search(BaseModel):
    model_config = _STRICT
    param: str = "workload.synthetic.qps"
    lo: Float = Field(0.5, gt=0, le=1e9)  # the bounds of workload.synthetic.qps
    hi: Float = Field(64.0, gt=0, le=1e9)
    iters: Int = Field(6, ge=1, le=30)  # bisection steps (in log space) after the two ends

    @model_validator(mode="after")
    def _order(self) -> Search:
        if self.lo >= self.hi:
            raise ValueError(f"search.lo ({self.lo}) must be < search.hi ({self.hi})")
        return self


class SweepSpec(BaseModel):
    model_config = _STRICT
    base: str
    grid: dict[str, list[Any]] = {}
    slo: Slo = Slo()
    search: Search | None = None

    @model_validator(mode="after")
    def _grid(self) -> SweepSpec:
        for k, v in self.grid.items():
            if not v:
                raise ValueError(f"grid.{k}: needs at least one value")
            if k.count(".") >= MAX_DEPTH:
                raise ValueError(f"grid.{k[:40]}...: at most {MAX_DEPTH} dotted parts")
        points = math.prod(len(v) for v in self.grid.values())
        if points > MAX_GRID_POINTS:  # each point is a whole simulation (times the search's)
            raise ValueError(f"grid: the values' product must be <= {MAX_GRID_POINTS} points "
                             f"(got {points})")
        if self.search is not None and self.search.param in self.grid:
            raise ValueError(f"grid.{self.search.param}: is the search parameter")
        if self.search is not None and not self.slo.root:
            raise ValueError("slo: a search needs at least one SLO, e.g. slo.ttft_p99_ms = 500")
        return self

    def points(self) -> list[dict[str, Any]]:
        """Every grid combination, first key slowest, in file order."""
        keys = list(self.grid)
        return [dict(zip(keys, vals, strict=True)) for vals in
                itertools.product(*(self.grid[k] for k in keys))]


def load_sweep(path: str | Path) -> tuple[SweepSpec, Path]:
    """Read and validate a sweep file; returns it and the base scenario's absolute path."""
    p = Path(path)
    data = load_toml(p, "sweep", MAX_SWEEP_BYTES)
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if msg.startswith(f"{loc}."):  # the message names the field inside loc itself
            loc = ""
        got = err.get("input")
        tail = "" if isinstance(got, dict | list) or got is None else f" (got {shown(got)})"
        if "(got " in msg:
            tail = ""
        raise ScenarioError((f"{p}: {loc}: {msg}" if loc else f"{p}: {msg}") + tail) from None
    return spec, (p.resolve().parent / spec.base)


def set_path(d: dict, dotted: str, value: Any, source: str) -> None:
    """Set `a.b.c` in a nested scenario dict, creating missing tables (the scenario's validation
    then rejects unknown names); a value in the way of a table is an error."""
    *parents, leaf = dotted.split(".")
    node = d
    for i, key in enumerate(parents):
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            where = ".".join(parents[: i + 1])
            raise ScenarioError(f"{source}: grid.{dotted}: {where} is a value, not a table")
        node = nxt
    node[leaf] = value
