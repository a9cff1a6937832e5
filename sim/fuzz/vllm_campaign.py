"""`kvsim fuzz --engine vllm`: many hypothesis workloads through vLLM's real scheduler.

Two passes, both seeded by `--seed`:

1. Search: `examples` workloads (or fewer, if `budget_s` runs out) are generated and each run
   through both engines (sim/fuzz/vllm_eval.py); nothing stops the pass, so it counts every
   workload that diverged (by first field), every invariant that fired and every crash.
2. Shrink: for each class seen (`diverged:FIELD`, an invariant, `crash:ENGINE`), hypothesis
   generates again from the same seed until it meets that class, shrinks it, and a greedy
   pass drops whole requests; each class gets at most `shrink_s` seconds, after which the
   smallest failure found so far stands.

All workloads run in one vLLM driver process (sim/engines/vllm.py, VllmSession).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis.errors import FlakyFailure, NoSuchExample

from sim.engines.vllm import VllmSession
from sim.fuzz.campaign import Hit, drop_requests, find_saved
from sim.fuzz.vllm_eval import Evaluator, Outcome
from sim.fuzz.vllm_strategies import vllm_scenario_dicts

SHRINK_S = 120.0  # per class: enough to reach a request or two on a busy machine


@dataclass
class Tally:
    """What the search pass saw."""

    workloads: int = 0
    clean: int = 0
    refused: int = 0
    diverged: Counter[str] = field(default_factory=Counter)  # first field -> workloads
    differs: Counter[str] = field(default_factory=Counter)  # field differs anywhere -> wl
    violations: Counter[str] = field(default_factory=Counter)  # invariant -> workloads
    crashes: Counter[str] = field(default_factory=Counter)  # engine -> workloads
    elapsed: float = 0.0
    shrinking: str = ""  # the class being shrunk, once the search pass is over

    def add(self, o: Outcome) -> None:
        if o.refused:
            self.refused += 1
            return
        self.workloads += 1
        self.clean += not o.classes
        if o.diverged:
            self.diverged[o.diverged] += 1
        self.differs.update(o.differs)
        self.violations.update(o.violations)
        if o.crash:
            self.crashes[o.crash] += 1

    def classes(self) -> list[str]:
        return ([f"diverged:{f}" for f in self.diverged] + list(self.violations)
                + [f"crash:{c}" for c in self.crashes])


@dataclass
class Shrunk:
    cls: str
    message: str
    scenario: dict[str, Any]


@dataclass(frozen=True)
class VllmCampaign:
    seed: int = 0
    examples: int = 100
    budget_s: float | None = None  # the search pass's time, besides `examples`
    shrink: bool = True
    shrink_s: float = SHRINK_S
    ignore: frozenset[str] = frozenset()  # invariants (or "crash") counted but not findings

    def findings(self, t: Tally) -> list[str]:
        """The classes that fail the campaign: all it saw, less the ignored."""
        return [c for c in t.classes()
                if c not in self.ignore and c.split(":")[0] not in self.ignore]

    def run(self, on_progress: Callable[[Tally], None] | None = None
            ) -> tuple[Tally, list[Shrunk]]:
        with VllmSession() as session:
            ev = Evaluator(session)
            try:
                tally = self._search(ev, on_progress)
                shrunk = []
                for c in self.findings(tally) if self.shrink else []:
                    tally.shrinking = c
                    if on_progress is not None:
                        on_progress(tally)
                    shrunk.append(self._shrink(ev, c))
                tally.shrinking = ""
            finally:
                ev.close()
        return tally, [s for s in shrunk if s is not None]

    def _search(self, ev: Evaluator, on_progress: Callable[[Tally], None] | None) -> Tally:
        tally, t0 = Tally(), time.monotonic()
        end = t0 + self.budget_s if self.budget_s is not None else float("inf")
        last = [0.0]

        @_settings(self.examples, (Phase.generate,))
        @given(vllm_scenario_dicts())
        def workload(d: dict[str, Any]) -> None:
            now = time.monotonic()
            if now >= end:
                raise _OutOfTime  # generate-only: hypothesis re-raises it without shrinking
            o = ev(d)
            assert o is not None
            tally.add(o)
            now = time.monotonic()
            tally.elapsed = now - t0
            if on_progress is not None and (now - last[0] > 1.0 or tally.workloads == 1):
                last[0] = now
                on_progress(tally)

        workload._hypothesis_internal_use_seed = self.seed  # type: ignore[attr-defined]
        try:
            workload()
        except _OutOfTime:
            pass
        tally.elapsed = time.monotonic() - t0
        if on_progress is not None:
            on_progress(tally)
        return tally

    def _shrink(self, ev: Evaluator, cls: str) -> Shrunk | None:
        """The search's first workload of class `cls`, found again and shrunk."""
        ev.frozen = False
        end = time.monotonic() + self.shrink_s

        def hit(d: dict[str, Any]) -> bool:
            ev.frozen = time.monotonic() > end  # past the time: only what is known
            o = ev(d)
            return o is not None and cls in o.classes

        s = _settings(self.examples, (Phase.generate, Phase.shrink))
        try:
            d = find_saved(hit, s, self.seed, b"", vllm_scenario_dicts())
        except (NoSuchExample, FlakyFailure):
            return None
        d, _ = drop_requests(_ClassGoal(hit, cls), d, Hit(cls, ""))
        ev.frozen = False
        o = ev(d)
        assert o is not None and cls in o.classes, "a shrunk workload no longer fails; " \
            "a run is not deterministic (a bug in kvsim's vLLM adapter)"
        return Shrunk(cls, o.messages.get(cls, ""), d)


class _OutOfTime(Exception):
    """The search pass's budget is spent."""


@dataclass(frozen=True)
class _ClassGoal:
    """drop_requests' view of a class: a workload hits it or not."""

    test: Callable[[dict[str, Any]], bool]
    cls: str

    def hit(self, sc: dict[str, Any]) -> tuple[Hit | None, None]:
        return (Hit(self.cls, "") if self.test(sc) else None), None


def _settings(examples: int, phases: tuple[Phase, ...]) -> settings:
    return settings(database=None, max_examples=examples, deadline=None, phases=phases,
                    suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                    derandomize=False, report_multiple_bugs=False)
