"""One workload through both engines: vLLM's real scheduler and kvsim's `vllm-v1` profile.

vLLM's run is recorded as a trace and checked online with kvsim's invariants (as `kvsim
record` does); kvsim's run is written as a trace; the two are compared step by step over the
whole run (sim/engines/diff.py, `--all`). What a workload did is an `Outcome`; its `classes`
are what a campaign counts and shrinks: `diverged:FIELD` (the first field that differs),
an invariant id, or `crash:vllm` / `crash:kvsim`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.api import parse_scenario, run
from sim.config import Scenario
from sim.engines.diff import compare, per_step
from sim.engines.record import record
from sim.engines.vllm import VllmSession, refuse_unsupported
from sim.errors import KvsimError, ScenarioError
from sim.fast import warm
from sim.fuzz.campaign import HANG_CONFIRM_S, SimulationHung, hang_guard

_SHOWN = 160  # characters of a differing value kept in a message
HANG_LOADED_S = 60.0  # a few-request workload runs in milliseconds; this long is a livelock


@dataclass(frozen=True)
class Outcome:
    """What one workload did under both engines."""

    diverged: str | None = None  # the first field that differs, at the first step that does
    step: int = -1  # that step
    differs: tuple[str, ...] = ()  # every field that differs at some step
    violations: tuple[str, ...] = ()  # invariants that fired on vLLM's run, first each
    crash: str | None = None  # "vllm" or "kvsim": that engine raised on the workload
    messages: dict[str, str] = field(default_factory=dict)  # class -> what happened
    refused: bool = False  # outside what the adapter expresses: counted, never a finding

    @property
    def classes(self) -> tuple[str, ...]:
        out = [f"diverged:{self.diverged}"] if self.diverged else []
        out += list(self.violations)
        if self.crash:
            out.append(f"crash:{self.crash}")
        return tuple(out)


class Evaluator:
    """Runs workloads in one vLLM driver process; remembers each outcome, so hypothesis's
    replays and a shrink's repeats cost nothing, and `frozen` answers only from memory (a
    shrink past its time stops on the smallest failure found)."""

    def __init__(self, session: VllmSession) -> None:
        self.session = session
        self.memo: dict[str, Outcome] = {}
        self.frozen = False
        self.tmp = Path(tempfile.mkdtemp(prefix="kvsim-vfuzz-"))
        warm()  # the fast engine's first compile (seconds, once) must not look like a hang

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __call__(self, d: dict[str, Any]) -> Outcome | None:
        key = json.dumps(d, sort_keys=True)
        if key not in self.memo:
            if self.frozen:
                return None
            self.memo[key] = self._evaluate(d)
        return self.memo[key]

    def _evaluate(self, d: dict[str, Any]) -> Outcome:
        try:
            sc = parse_scenario(d, "<fuzz>")
            refuse_unsupported(sc, "<fuzz>")
        except ScenarioError:
            return Outcome(refused=True)
        work = self.tmp / "run"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            rec = record(sc, work / "vllm", where="<fuzz>", session=self.session)
        except ScenarioError:  # vLLM would not start with this pool
            return Outcome(refused=True)
        except KvsimError as e:
            return Outcome(crash="vllm", messages={"crash:vllm": str(e)})
        violations: dict[str, str] = {}
        for v in rec.violations:
            violations.setdefault(v.invariant, f"step {v.step}: {v.message}")
        try:
            _run_kvsim(sc, work / "kvsim")
        except Exception as e:  # noqa: BLE001 - a crash or hang of the profile
            return Outcome(violations=tuple(violations), crash="kvsim",
                           messages={**violations, "crash:kvsim": f"{type(e).__name__}: {e}"})
        res = compare(per_step(work / "kvsim"), per_step(work / "vllm"), every=True)
        if res.first is None:
            return Outcome(violations=tuple(violations), messages=violations)
        f = res.first
        msg = (f"step {f.step}, {f.field}: kvsim {_short(f.kvsim)} / vLLM {_short(f.vllm)}")
        return Outcome(diverged=f.field, step=f.step, differs=tuple(res.tally),
                       violations=tuple(violations),
                       messages={**violations, f"diverged:{f.field}": msg})


def _run_kvsim(sc: Scenario, out: Path) -> None:
    """The profile's run; one that outlasts HANG_CONFIRM_S is given HANG_LOADED_S (a busy
    machine) before it counts as a hang."""
    try:
        with hang_guard(HANG_CONFIRM_S):
            run(sc, out=out, check=False, profile="vllm-v1", collect=False)
        return
    except SimulationHung:
        shutil.rmtree(out, ignore_errors=True)
    with hang_guard(HANG_LOADED_S):
        run(sc, out=out, check=False, profile="vllm-v1", collect=False)


def _short(v: object) -> str:
    s = repr(v)
    return s if len(s) <= _SHOWN else s[:_SHOWN] + " …"
