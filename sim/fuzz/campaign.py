"""One search process: generate scenarios, run them under a profile, shrink the first violation.

The search is a loop of `hypothesis.find` batches rather than one endless run, because a
hypothesis run cannot be stopped at a deadline without counting the stop as a failure (and
shrinking it). Each batch gets its own derived random seed; all batches share the example
database under one key per profile, so a rerun with the same database replays saved failures
first (that is how a campaign resumes).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from random import Random
from typing import Any, Protocol

from hypothesis import HealthCheck, Phase, Verbosity, event, given, settings, target
from hypothesis.database import ExampleDatabase
from hypothesis.errors import FlakyFailure, NoSuchExample
from hypothesis.strategies import SearchStrategy

from sim.api import RunResult, parse_scenario, run
from sim.errors import KvsimError
from sim.fast import warm
from sim.fuzz.labels import path_labels, target_value
from sim.fuzz.strategies import scenario_dicts

# The generated scenarios finish in milliseconds; a run this long is a livelock, not load.
HANG_S = 0.5
HANG_CONFIRM_S = 5.0
BATCH = 300  # examples per find(): long enough for hypothesis to mutate, short enough to stop
MAX_REQUESTS = 3  # a finding this small is done; larger ones search on for up to SMALLER_S
SMALLER_S = 30.0


@dataclass(frozen=True)
class Hit:
    invariant: str  # an invariant id, or "crash" when the simulator itself raised
    message: str


@dataclass
class Finding:
    hit: Hit
    profile: str
    seed: int
    scenario: dict[str, Any]
    examples: int
    found_s: float  # time to the first failing example (before shrinking)
    shrunk_s: float  # time to the shrunk one
    found_example: int = 0  # how many examples ran up to the first failing one (1: replayed)


@dataclass
class Stats:
    """What a search has seen so far; shipped to the terminal (and across processes)."""

    examples: int = 0
    paths: set[tuple[str, ...]] = field(default_factory=set)
    best_target: float = 0.0


class SimulationHung(Exception):
    """One tiny scenario ran far longer than any should: the engine loops (a liveness bug)."""


def _alarm(_sig: int, _frame: object) -> None:
    raise SimulationHung("no result in time")


def _quiet_alarm(hook: Callable[[Any], object]) -> Callable[[Any], object]:
    """Drop the alarms Python swallows inside gc callbacks instead of printing each one."""
    def quiet(u: Any) -> object:
        return None if isinstance(u.exc_value, SimulationHung) else hook(u)
    return quiet


@contextmanager
def hang_guard(seconds: float) -> Iterator[None]:
    """Interrupt a run that exceeds `seconds` (only possible on the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old, old_hook = signal.signal(signal.SIGALRM, _alarm), sys.unraisablehook
    sys.unraisablehook = _quiet_alarm(old_hook)
    # Re-arm every 0.2 s: an alarm that lands inside a gc callback is swallowed by Python
    # ("Exception ignored in ..."), so one shot alone could leave a livelock running forever.
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.2)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        sys.unraisablehook = old_hook


def evaluate(sc: dict[str, Any], profile: str, hang_s: float = HANG_S
             ) -> tuple[list[Hit], RunResult | None]:
    """Run one scenario dict; return its violations (or one crash/hang) and the result."""
    scenario = parse_scenario({**sc, "profile": profile}, "<fuzz>")
    warm()  # the fast engine's first compile (seconds, once) must not look like a hang
    try:
        with hang_guard(hang_s):
            res = run(scenario, profile=profile)
    except KvsimError:
        # The profile refuses this combination (e.g. draft-layer KV without a reserved-width
        # table): not a finding, just a scenario outside what the profile models.
        return [], None
    except SimulationHung as e:
        return [Hit("hang", f"the simulation did not finish in {hang_s} s ({e})")], None
    except Exception as e:  # noqa: BLE001 - any crash of the model is a finding
        return [Hit("crash", f"{type(e).__name__}: {e}")], None
    return [Hit(v.invariant, v.message) for v in res.violations], res


@dataclass(frozen=True)
class Goal:
    """What counts as a finding: a violation under `profile`, except the `ignore`d invariants
    (known bugs, so a long campaign keeps looking past them), and, with a `baseline` profile,
    only where the baseline is clean (finds what a fault switch adds, not what the base has)."""

    profile: str
    ignore: frozenset[str] = frozenset()
    baseline: str | None = None

    def hit(self, sc: dict[str, Any]) -> tuple[Hit | None, RunResult | None]:
        hits, res = evaluate(sc, self.profile)
        hit = next((h for h in hits if h.invariant not in self.ignore), None)
        if hit is not None and hit.invariant == "hang":
            # A loaded machine can stall one run past HANG_S: confirm with a long limit.
            hits, res = evaluate(sc, self.profile, HANG_CONFIRM_S)
            hit = next((h for h in hits if h.invariant not in self.ignore), None)
        if hit is None:
            return None, res
        if self.baseline is not None and evaluate(sc, self.baseline)[0]:
            return None, res
        return hit, res


class Search:
    """Runs batches until a failure is found and shrunk, or until `deadline` (monotonic s)."""

    def __init__(self, goal: Goal, seed: int, db: ExampleDatabase | None,
                 on_stats: Callable[[Stats], None] | None = None, worker: int = 0) -> None:
        self.goal, self.seed, self.db, self.worker = goal, seed, db, worker
        self.profile = goal.profile
        self.on_stats = on_stats
        self.stats = Stats()
        self.t0 = time.monotonic()
        self.found_at: float | None = None
        self.found_example = 0
        self._smaller_until = 0.0
        self._last_report = 0.0

    def condition(self, sc: dict[str, Any]) -> bool:
        hit, res = self.goal.hit(sc)
        self.stats.examples += 1
        if res is not None:
            labels = path_labels(sc, res)
            for lab in labels:
                event(lab)
            self.stats.paths.add(labels)
            value = target_value(res)
            target(value)
            self.stats.best_target = max(self.stats.best_target, value)
        if hit is not None and self.found_at is None:
            self.found_at = time.monotonic() - self.t0
            self.found_example = self.stats.examples
        self._report()
        return hit is not None

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.on_stats is not None and (force or now - self._last_report > 0.5):
            self._last_report = now
            self.on_stats(self.stats)

    def run(self, deadline: float) -> Finding | None:
        # Warm-up: the first run pays for lazy imports, which must not look like a hang.
        evaluate({"workload": {"requests": [{"arrival_ns": 0, "prompt_len": 1,
                                             "output_len": 1}]}}, self.profile, HANG_CONFIRM_S)
        batch, best = 0, None
        while time.monotonic() < deadline:
            rnd = Random(f"kvsim-fuzz:{self.seed}:{self.worker}:{batch}")  # str seed: stable
            batch += 1
            cond = self.condition if best is None else self._fewer(_num_requests(best[0]))
            try:
                sc = find_saved(cond, self._settings(), rnd.getrandbits(64),
                                database_key(self.profile))
            except (NoSuchExample, FlakyFailure):
                # Flaky: a "hang" that did not repeat under load; the batch is spent either way.
                if best is not None and time.monotonic() > self._smaller_until:
                    break
                continue
            self._report(force=True)
            hit, _ = self.goal.hit(sc)
            assert hit is not None, "shrunk example no longer fails; the simulator is not " \
                                    "deterministic (a bug in kvsim)"
            best = drop_requests(self.goal, sc, hit)
            if _num_requests(best[0]) <= MAX_REQUESTS:
                break
            # Shrinking stopped at a local minimum with many requests: search a little longer
            # for a failure with fewer (another shape often reaches 2).
            self._smaller_until = min(deadline, time.monotonic() + SMALLER_S)
        self._report(force=True)
        if best is None:
            return None
        return Finding(best[1], self.profile, self.seed, best[0], self.stats.examples,
                       self.found_at or 0.0, time.monotonic() - self.t0, self.found_example)

    def _fewer(self, n: int) -> Callable[[dict[str, Any]], bool]:
        return lambda sc: _num_requests(sc) < n and self.condition(sc)

    def _settings(self) -> settings:
        return settings(database=self.db, max_examples=BATCH, deadline=None,
                        phases=(Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
                        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                        derandomize=False, report_multiple_bugs=False)


class _Found(Exception):
    pass


def find_saved(condition: Callable[[dict[str, Any]], bool], s: settings, seed: int,
               key: bytes, strategy: SearchStrategy | None = None) -> dict[str, Any]:
    """`hypothesis.find` with a seed *and* the example database. `find(random=...)` applies
    `@seed`, which switches the database off, and then nothing is saved or replayed; setting
    the seed attribute directly keeps both. `strategy` defaults to `scenario_dicts()`. Raises
    NoSuchExample when nothing matched."""
    last: list[dict[str, Any]] = []

    @s
    @given(strategy if strategy is not None else scenario_dicts())
    def test(v: dict[str, Any]) -> None:
        if condition(v):
            last[:] = [v]  # the final call hypothesis makes is on the shrunk example
            raise _Found

    test._hypothesis_internal_use_seed = seed  # type: ignore[attr-defined]
    test._hypothesis_internal_database_key = key  # type: ignore[attr-defined]
    try:
        test()
    except _Found:
        return last[0]
    raise NoSuchExample("kvsim scenario")


def _num_requests(sc: dict[str, Any]) -> int:
    return len(sc.get("workload", {}).get("requests") or [])


class Judge(Protocol):
    """What drop_requests asks of a goal: does this scenario still fail, and how."""

    def hit(self, sc: dict[str, Any]) -> tuple[Hit | None, object]: ...


def drop_requests(goal: Judge, sc: dict[str, Any], hit: Hit) -> tuple[dict[str, Any], Hit]:
    """Greedy pass after hypothesis's shrink: remove whole requests while the same invariant
    still fires. Hypothesis shrinks a list from its end and can stall at a local minimum where
    a request in the middle is the one not needed."""
    reqs = sc.get("workload", {}).get("requests") or []
    i = 0
    while len(reqs) > 1 and i < len(reqs):
        trial = {**sc, "workload": {**sc["workload"], "requests": reqs[:i] + reqs[i + 1:]}}
        got, _ = goal.hit(trial)
        if got is not None and got.invariant == hit.invariant:
            sc, hit, reqs = trial, got, trial["workload"]["requests"]
        else:
            i += 1
    return sc, hit


def database_key(profile: str) -> bytes:
    return f"kvsim-fuzz:{profile}".encode()
