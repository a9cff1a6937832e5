"""Fan the grid points out to a process pool (or Ray), collect one row per point."""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sim import interrupt
from sim.errors import KvsimError, ScenarioError
from sim.sweep.spec import SweepSpec, set_path
from sim.sweep.worker import PointTask, run_point


@dataclass
class SweepOutcome:
    results: pa.Table
    computed: int  # simulations run now
    cached: int  # simulations read from the cache
    seconds: float
    plot: Path | None


def _version() -> str:
    try:
        return importlib.metadata.version("kvsim")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _base(path: Path) -> tuple[dict, Path]:
    from sim.api import load_scenario

    loaded = load_scenario(path)
    sc, base_dir = loaded if isinstance(loaded, tuple) else (loaded, path.resolve().parent)
    # What the file set, not the full dump: a full dump need not validate again (mutually
    # exclusive sections dump as their defaults). The cache key hashes the normalized form.
    d = sc.model_dump(mode="json", exclude_unset=True)
    cal = d.get("cost", {}).get("calibration")
    if cal and not Path(cal).is_absolute():  # workers may run elsewhere: pin it to the base
        d["cost"]["calibration"] = str((Path(base_dir) / cal).resolve())
    return d, Path(base_dir)


def make_tasks(spec: SweepSpec, base_path: Path, out: Path) -> list[PointTask]:
    """One validated task per grid point. Raises ScenarioError naming the grid key at fault."""
    from sim.api import parse_scenario

    base, base_dir = _base(base_path)
    tasks = []
    for i, values in enumerate(spec.points()):
        sc = _deep(base)
        for k, v in values.items():
            set_path(sc, k, v, str(base_path))
        where = ", ".join(f"{k}={v!r}" for k, v in values.items())
        parse_scenario(sc, f"{base_path} with {where or 'no grid'}")
        if spec.search is not None:
            probe = _deep(sc)
            set_path(probe, spec.search.param, spec.search.lo, str(base_path))
            parse_scenario(probe, f"{base_path} with {spec.search.param}")
        search = spec.search.model_dump() if spec.search is not None else None
        tasks.append(PointTask(i, sc, str(base_dir), str(out / "cache"), _version(),
                               spec.slo.model_dump(), search, values))
    return tasks


def _deep(d: dict) -> dict:
    return {k: _deep(v) if isinstance(v, dict) else v for k, v in d.items()}


def _local(tasks: list[PointTask], workers: int) -> Iterator[tuple[PointTask, dict]]:
    if workers <= 1:
        for t in tasks:
            yield t, run_point(t)
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futs = {pool.submit(run_point, t): t for t in tasks}
        for f in as_completed(futs):
            yield futs[f], f.result()


def _ray(tasks: list[PointTask], address: str) -> Iterator[tuple[PointTask, dict]]:
    try:
        import ray  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise KvsimError("--address needs Ray: pip install 'kvsim[ray]'") from None
    ray.init(address=address, ignore_reinit_error=True)
    remote = ray.remote(run_point)
    pending = {remote.remote(t): t for t in tasks}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            yield pending.pop(ref), ray.get(ref)


def run_sweep(spec: SweepSpec, base_path: Path, out: Path, *, workers: int = 0,
              address: str | None = None, on_done: Callable[[int, int], None] | None = None
              ) -> SweepOutcome:
    """Run every grid point (cached ones are free), write results.parquet and sweep.png."""
    t0 = time.perf_counter()
    tasks = make_tasks(spec, base_path, out)  # validates every point: nothing written yet
    out.mkdir(parents=True, exist_ok=True)
    workers = workers or min(len(tasks), os.cpu_count() or 1)
    it = _ray(tasks, address) if address else _local(tasks, workers)
    rows: list[tuple[int, dict]] = []
    computed = cached = 0
    for task, m in it:
        computed, cached = computed + m.pop("_computed"), cached + m.pop("_cached")
        rows.append((task.index, {f"grid.{k}": v for k, v in task.values.items()} | m))
        if on_done:
            on_done(len(rows), len(tasks))
    table = pa.Table.from_pylist([r for _, r in sorted(rows, key=lambda r: r[0])])
    _write_atomic(table, out / "results.parquet")
    from sim.sweep.plot import plot_sweep

    png = plot_sweep(table, spec, out / "sweep.png")
    return SweepOutcome(table, computed, cached, time.perf_counter() - t0, png)


def _write_atomic(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        interrupt.check()  # a swallowed SIGTERM must not publish (sim/interrupt.py)
        os.replace(tmp, path)
    except OSError as e:
        raise ScenarioError(f"{path}: cannot write results: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def sweep(base: str | Path, grid: dict, out: str | Path, *, slo: dict | None = None,
          search: dict | None = None, workers: int = 0) -> pa.Table:
    """`run_sweep` without a sweep file (notebooks): returns the results table."""
    spec = SweepSpec.model_validate({"base": str(base), "grid": grid, "slo": slo or {},
                                     "search": search})
    return run_sweep(spec, Path(base).resolve(), Path(out), workers=workers).results
