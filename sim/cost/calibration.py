"""Measured kernel times (a `calibration/*.json` written on a GPU) and their interpolation.

File format::

    {"meta": {...},
     "attention": [{"kind": "decode"|"verify"|"prefill", "batch", "kv_len", "q_len", "page_size",
                    "num_q_heads", "num_kv_heads", "head_dim", "us"}, ...],
     "gemm": [{"m", "n", "k", "us"}, ...]}

Attention entries are one layer's kernel for a whole batch of rows of equal q_len and kv_len.
They are grouped by (kind, q_len) into a grid over (batch, kv_len) and interpolated bilinearly in
log space. Past the largest measured batch or kv_len the time grows in proportion (the kernels are
bandwidth- or compute-bound there); below the smallest it is clamped (launch-bound). Prefill
queries at an unmeasured q_len use the nearest measured q_len, scaled by q_len.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from functools import lru_cache

import numpy as np

from sim.errors import ScenarioError
from sim.inputs import load_json, shown

MAX_CALIBRATION_BYTES = 2**24
MAX_AXIS = 64  # distinct batch (or m) and kv_len values per group; a real sweep uses ~10
MAX_VALUE = 1e12  # any size or time in microseconds; far past a real kernel's
_ATTN_KEYS = ("kind", "batch", "kv_len", "q_len", "page_size", "num_q_heads", "num_kv_heads",
              "head_dim", "us")


class Grid:
    """Times on a (x, y) grid, both axes positive; `at` interpolates bilinearly in log space."""

    def __init__(self, points: dict[tuple[float, float], float]) -> None:
        self.xs = sorted({x for x, _ in points})
        self.ys = sorted({y for _, y in points})
        self.lx = [math.log(x) for x in self.xs]
        self.ly = [math.log(y) for y in self.ys]
        self.t = np.empty((len(self.xs), len(self.ys)))
        for i, x in enumerate(self.xs):
            for j, y in enumerate(self.ys):
                self.t[i, j] = points.get((x, y), math.nan)
        if np.isnan(self.t).any():
            self._fill(points)

    def _fill(self, points: dict[tuple[float, float], float]) -> None:
        """A cell not measured takes its log-nearest measured neighbour, scaled by x·y."""
        known = [(math.log(x), math.log(y), x, y, t) for (x, y), t in points.items()]
        for i, j in zip(*np.nonzero(np.isnan(self.t)), strict=True):
            lx, ly = self.lx[i], self.ly[j]
            _, _, x, y, t = min(known, key=lambda k: (k[0] - lx) ** 2 + (k[1] - ly) ** 2)
            self.t[i, j] = t * self.xs[i] * self.ys[j] / (x * y)

    def at(self, x: float, y: float) -> float:
        i, fx, sx = _locate(self.xs, self.lx, x)
        j, fy, sy = _locate(self.ys, self.ly, y)
        t = self.t
        i1, j1 = min(i + 1, len(self.xs) - 1), min(j + 1, len(self.ys) - 1)
        lo = t[i, j] * (1 - fy) + t[i, j1] * fy
        hi = t[i1, j] * (1 - fy) + t[i1, j1] * fy
        return float((lo * (1 - fx) + hi * fx) * sx * sy)


def _locate(vals: list[float], logs: list[float], v: float) -> tuple[int, float, float]:
    """(cell index, fraction inside the cell in log space, proportional scale past the top)."""
    if v <= vals[0]:
        return 0, 0.0, 1.0
    if v >= vals[-1]:
        return len(vals) - 1, 0.0, v / vals[-1]
    i = bisect_right(vals, v) - 1
    return i, (math.log(v) - logs[i]) / (logs[i + 1] - logs[i]), 1.0


class Calibration:
    """Attention and GEMM times for one model shard, from one calibration file."""

    def __init__(self, attn: dict[tuple[str, int], Grid], gemm: dict[tuple[int, int], Grid],
                 meta: dict) -> None:
        self.attn, self.gemm, self.meta = attn, gemm, meta
        self._q: dict[str, list[int]] = {}
        for kind, q in sorted(attn):
            self._q.setdefault(kind, []).append(q)

    def attention_us(self, kind: str, batch: int, q_len: float, kv_len: float) -> float | None:
        """One layer's attention for `batch` rows; None when the file has no such kind."""
        qs = self._q.get(kind)
        if not qs:
            return None
        qt = min(qs, key=lambda q: (abs(math.log(q) - math.log(max(q_len, 1.0))), q))
        scale = q_len / qt if kind == "prefill" else 1.0
        return self.attn[kind, qt].at(batch, max(kv_len, 1.0)) * scale

    def gemm_us(self, m: int, n: int, k: int) -> float | None:
        g = self.gemm.get((n, k))
        return None if g is None else g.at(m, 1.0)


def _need(entry: object, keys: tuple[str, ...], where: str) -> dict:
    if not isinstance(entry, dict):
        raise ScenarioError(f"{where}: expected an object")
    missing = [k for k in keys if k not in entry]
    if missing:
        raise ScenarioError(f"{where}: missing field(s) {', '.join(missing)}")
    for k in keys:
        v = entry[k]
        if k != "kind" and (type(v) not in (int, float) or not 0 < v <= MAX_VALUE):
            raise ScenarioError(f"{where}.{k}: a number in (0, {MAX_VALUE:g}] (got {shown(v)})")
    return entry


def _grid(points: dict[tuple[float, float], float], where: str, x: str) -> Grid:
    """A Grid, refused when an axis has more than MAX_AXIS values: filling the unmeasured
    cells costs (cells x measured points)."""
    for axis, name in ((0, x), (1, "kv_len")):
        n = len({p[axis] for p in points})
        if n > MAX_AXIS:
            raise ScenarioError(f"{where}: {name}: at most {MAX_AXIS} distinct values per "
                                f"group (got {n})")
    return Grid(points)


def _attention(raw: list, path: str, heads: tuple[int, int, int], page_size: int
               ) -> dict[tuple[str, int], Grid]:
    rows = [_need(e, _ATTN_KEYS, f"{path}: attention[{i}]") for i, e in enumerate(raw)]
    shape = [e for e in rows if (e["num_q_heads"], e["num_kv_heads"], e["head_dim"]) == heads]
    if rows and not shape:
        have = sorted({(e["num_q_heads"], e["num_kv_heads"], e["head_dim"]) for e in rows})
        raise ScenarioError(f"{path}: attention: no entry for (num_q_heads, num_kv_heads, "
                            f"head_dim) = {heads}; the file has {have}")
    if shape and not page_size:  # the most common page size, ties to the smallest
        counts = Counter(e["page_size"] for e in shape).items()
        page_size = min(counts, key=lambda c: (-c[1], c[0]))[0]
    groups: dict[tuple[str, int], dict[tuple[float, float], float]] = {}
    for e in shape:
        if min(e["batch"], e["kv_len"], e["q_len"], e["us"]) <= 0:
            raise ValueError(f"batch, kv_len, q_len and us must be > 0: {e}")
        if e["kind"] not in ("decode", "verify", "prefill"):
            raise ValueError(f"kind must be decode, verify or prefill: {e}")
        if e["page_size"] == page_size:
            groups.setdefault((e["kind"], int(e["q_len"])), {})[
                (float(e["batch"]), float(e["kv_len"]))] = float(e["us"])
    return {key: _grid(pts, f"{path}: attention {key}", "batch") for key, pts in groups.items()}


def _gemm(raw: list, path: str) -> dict[tuple[int, int], Grid]:
    groups: dict[tuple[int, int], dict[tuple[float, float], float]] = {}
    for i, e in enumerate(raw):
        _need(e, ("m", "n", "k", "us"), f"{path}: gemm[{i}]")
        if min(e["m"], e["us"]) <= 0:
            raise ValueError(f"gemm[{i}]: m and us must be > 0")
        groups.setdefault((int(e["n"]), int(e["k"])), {})[(float(e["m"]), 1.0)] = float(e["us"])
    return {key: _grid(pts, f"{path}: gemm (n, k) = {key}", "m") for key, pts in groups.items()}


@lru_cache(maxsize=16)
def load_calibration(path: str, heads: tuple[int, int, int], page_size: int = 0) -> Calibration:
    """Read a calibration file for a model shard of `heads` = (q heads, kv heads, head dim).

    `page_size` 0 picks the page size measured most often. Raises ScenarioError naming the file
    and the entry on anything malformed.
    """
    data = load_json(path, "calibration", MAX_CALIBRATION_BYTES)
    if not isinstance(data, dict) or not isinstance(data.get("attention", []), list) \
            or not isinstance(data.get("gemm", []), list) \
            or not isinstance(data.get("meta", {}), dict):
        raise ScenarioError(f"{path}: expected an object with 'attention' and 'gemm' lists "
                            "and a 'meta' object")
    try:
        attn = _attention(data.get("attention", []), path, heads, page_size)
        gemm = _gemm(data.get("gemm", []), path)
    except (TypeError, ValueError) as e:
        raise ScenarioError(f"{path}: bad value: {e}") from None
    return Calibration(attn, gemm, dict(data.get("meta", {})))
