"""DIR/sweep.png: the sweep's headline metric against its first grid key, one line per combination
of the other keys. Skipped (None) when matplotlib is not installed: the sweep then says NO_PLOT."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

from sim.sweep.spec import SweepSpec

NO_PLOT = "no plot: matplotlib is not installed (pip install 'kvsim[plot]')"


def headline(spec: SweepSpec) -> str:
    """The one number a grid point answers: max QPS under the SLO, goodput, or throughput."""
    if spec.search is not None:
        return "max_qps"
    return "goodput_rps" if spec.slo.root else "throughput_rps"


def plot_sweep(table: pa.Table, spec: SweepSpec, path: Path) -> Path | None:
    try:  # a bare Figure, not pyplot: the caller's backend (a notebook's inline one) is untouched
        from matplotlib.figure import Figure
    except ImportError:
        return None
    y = headline(spec)
    keys = [f"grid.{k}" for k in spec.grid]
    rows = table.to_pylist()
    fig = Figure(figsize=(6, 3.6), dpi=90)
    ax = fig.subplots()
    if not keys:
        ax.bar(["base"], [rows[0][y]])
    else:
        series: dict[str, list[tuple]] = {}
        for r in rows:
            label = ", ".join(f"{k[5:]}={r[k]}" for k in keys[1:]) or y
            series.setdefault(label, []).append((r[keys[0]], r[y]))
        for label, pts in series.items():
            xs = [str(x) for x, _ in pts]
            ax.plot(xs, [v for _, v in pts], marker="o", label=label)
        ax.set_xlabel(keys[0][5:])
        ax.legend(fontsize=7)
    ax.set_ylabel(y)
    ax.set_title(f"{y} (SLO: {spec.slo})", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    os.replace(tmp, path)
    return path
