"""Fan the grid points out to a process pool (or Ray), collect one row per point."""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sim import interrupt
from sim.errors import ScenarioError
from sim.outputs import (
    Kind,
    OutputError,
    is_output,
    publish,
    remove_stale,
    temp_path,
    write_marker,
)
from sim.sweep.cluster import connect, run_points
from sim.sweep.spec import SweepSpec, set_path
from sim.sweep.worker import PointTask, run_point


@dataclass
class SweepOutcome:
    results: pa.Table
    computed: int  # simulations run now
    cached: int  # simulations read from the cache
    seconds: float
    plot: Path | None
    notes: list[str]  # what the sweep left out, and why (the CLI prints them on stderr)


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


def make_tasks(spec: SweepSpec, base_path: Path, out: Path, synthetic_workload: bool = False
               ) -> list[PointTask]:
    """One validated task per grid point. Raises ScenarioError naming the grid key at fault.

    `synthetic_workload`: each point runs its `workload.trace.fallback` in place of the trace
    (its own scenario then, so the cache keeps the two apart)."""
    from sim.api import parse_scenario
    from sim.workload import stand_in

    base, base_dir = _base(base_path)
    cache = out.resolve() / "cache"  # absolute: a Ray worker's working directory is not ours
    tasks = []
    for i, values in enumerate(spec.points()):
        sc = _deep(base)
        for k, v in values.items():
            set_path(sc, k, v, str(base_path))
        where = ", ".join(f"{k}={v!r}" for k, v in values.items())
        parsed = parse_scenario(sc, f"{base_path} with {where or 'no grid'}")
        if synthetic_workload:
            sc["workload"] = stand_in(parsed.workload).model_dump(mode="json")
        if spec.search is not None:
            probe = _deep(sc)
            set_path(probe, spec.search.param, spec.search.lo, str(base_path))
            parse_scenario(probe, f"{base_path} with {spec.search.param}")
        search = spec.search.model_dump() if spec.search is not None else None
        tasks.append(PointTask(i, sc, str(base_dir), str(cache), _version(),
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


def run_sweep(spec: SweepSpec, base_path: Path, out: Path, *, workers: int = 0,
              address: str | None = None, on_done: Callable[[int, int], None] | None = None,
              fresh: bool = False, synthetic_workload: bool = False) -> SweepOutcome:
    """Run every grid point (cached ones are free), write results.parquet and sweep.png.

    `out` is created, or resumed when it is a sweep folder already; `fresh` over an old sweep
    builds a new one in a temporary sibling that replaces it at the end. Any other non-empty
    folder is refused (OutputError), and a sweep that fails validation writes nothing."""
    t0 = time.perf_counter()
    work = temp_path(out) if fresh and out.exists() else out
    tasks = make_tasks(spec, base_path, work, synthetic_workload)
    ray = connect(address) if address else None  # before anything is written
    try:
        created = _open(work, out)
        try:
            workers = workers or min(len(tasks), os.cpu_count() or 1)
            it = run_points(ray, tasks) if ray is not None else _local(tasks, workers)
            table, computed, cached = _collect(it, len(tasks), on_done)
            _write_atomic(table, work / "results.parquet")
            from sim.sweep.plot import NO_PLOT, plot_sweep

            png = plot_sweep(table, spec, work / "sweep.png")
            if work != out:
                publish(work, out, Kind.SWEEP)
                png = out / png.name if png is not None else None
        except BaseException:
            if work != out:
                shutil.rmtree(work, ignore_errors=True)
            elif created and not any((out / "cache").glob("*/*.json")):
                shutil.rmtree(out, ignore_errors=True)  # nothing done: leave nothing behind
            raise
    finally:
        if ray is not None:
            ray.shutdown()
    notes = [NO_PLOT] if png is None else []
    return SweepOutcome(table, computed, cached, time.perf_counter() - t0, png, notes)


def _open(work: Path, out: Path) -> bool:
    """Make `work` ready for the sweep's files; True when this call created it."""
    remove_stale(out)  # a killed forced sweep's temporary folder
    if work != out:
        shutil.rmtree(work, ignore_errors=True)  # our own pid's: a dead namesake's leftover
    elif out.is_dir() and any(out.iterdir()):
        if not is_output(out, Kind.SWEEP):
            raise OutputError(f"{out}: exists and is not a kvsim sweep folder; "
                              "choose another --out")
        return False
    created = not out.exists()
    work.mkdir(parents=True, exist_ok=True)
    write_marker(work, Kind.SWEEP)
    return created


def _collect(it: Iterator[tuple[PointTask, dict]], total: int,
             on_done: Callable[[int, int], None] | None) -> tuple[pa.Table, int, int]:
    """The results table in grid order, and how many simulations were run and cached."""
    rows: list[tuple[int, dict]] = []
    computed = cached = 0
    for task, m in it:
        computed, cached = computed + m.pop("_computed"), cached + m.pop("_cached")
        rows.append((task.index, {f"grid.{k}": v for k, v in task.values.items()} | m))
        if on_done:
            on_done(len(rows), total)
    table = pa.Table.from_pylist([r for _, r in sorted(rows, key=lambda r: r[0])])
    return table, computed, cached


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
          search: dict | None = None, workers: int = 0,
          synthetic_workload: bool = False) -> pa.Table:
    """`run_sweep` without a sweep file (notebooks): returns the results table."""
    spec = SweepSpec.model_validate({"base": str(base), "grid": grid, "slo": slo or {},
                                     "search": search})
    return run_sweep(spec, Path(base).resolve(), Path(out), workers=workers,
                     synthetic_workload=synthetic_workload).results
