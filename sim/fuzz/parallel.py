"""A campaign over N worker processes that share one example database.

Each worker runs its own `Search` with its own seed stream and sends its statistics and any
finding to the parent over a queue. The first finding ends the campaign: the parent stops the
other workers it started (by their Process handles, nothing else).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis.database import DirectoryBasedExampleDatabase

from sim.fuzz.campaign import Finding, Goal, Search, Stats


@dataclass
class Progress:
    """Campaign-wide view: the sum over workers."""

    examples: int = 0
    paths: set[tuple[str, ...]] = field(default_factory=set)
    best_target: float = 0.0
    elapsed: float = 0.0
    per_worker: dict[int, int] = field(default_factory=dict)

    def merge(self, worker: int, s: Stats) -> None:
        self.per_worker[worker] = s.examples
        self.examples = sum(self.per_worker.values())
        self.paths |= s.paths
        self.best_target = max(self.best_target, s.best_target)


@dataclass(frozen=True)
class CampaignConfig:
    profile: str
    budget_s: float
    seed: int = 0
    workers: int = 1
    db: Path | None = None
    ignore: frozenset[str] = frozenset()
    baseline: str | None = None

    @property
    def goal(self) -> Goal:
        return Goal(self.profile, self.ignore, self.baseline)


def _open_db(db: Path | None) -> DirectoryBasedExampleDatabase | None:
    return DirectoryBasedExampleDatabase(str(db)) if db is not None else None


def _worker(cfg: CampaignConfig, worker: int, deadline_wall: float, q: mp.Queue) -> None:
    # The parent ends workers with SIGTERM; the CLI's own handler (inherited through fork)
    # would turn that into a KeyboardInterrupt traceback.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Monotonic clocks are per process; the deadline crosses processes as wall time.
    deadline = time.monotonic() + max(0.0, deadline_wall - time.time())
    search = Search(cfg.goal, cfg.seed, _open_db(cfg.db),
                    on_stats=lambda s: q.put(("stats", worker, s)), worker=worker)
    try:
        q.put(("done", worker, search.run(deadline)))
    except BaseException as e:  # noqa: BLE001 - report, don't hang the parent
        q.put(("error", worker, f"{type(e).__name__}: {e}"))


def run_campaign(cfg: CampaignConfig, on_progress: Callable[[Progress], None] | None = None
                 ) -> tuple[Finding | None, Progress]:
    """Run until a finding (returned shrunk) or the budget ends (returns None)."""
    prog = Progress()
    t0 = time.monotonic()

    def tick(worker: int, s: Stats) -> None:
        prog.merge(worker, s)
        prog.elapsed = time.monotonic() - t0
        if on_progress is not None:
            on_progress(prog)

    if cfg.workers == 1:  # in-process: no fork, and the bench's one-core timing stays honest
        search = Search(cfg.goal, cfg.seed, _open_db(cfg.db),
                        on_stats=lambda s: tick(0, s))
        return search.run(t0 + cfg.budget_s), prog
    return _run_processes(cfg, tick), prog


def _run_processes(cfg: CampaignConfig, tick: Callable[[int, Stats], None]) -> Finding | None:
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    deadline_wall = time.time() + cfg.budget_s
    procs = [ctx.Process(target=_worker, args=(cfg, i, deadline_wall, q), daemon=True)
             for i in range(cfg.workers)]
    for p in procs:
        p.start()
    finding, running = None, len(procs)
    try:
        while running and finding is None:
            try:
                kind, worker, payload = q.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if kind == "stats":
                tick(worker, payload)
            elif kind == "error":
                raise RuntimeError(f"fuzz worker {worker} failed: {payload}")
            else:
                running -= 1
                finding = payload
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    return finding
