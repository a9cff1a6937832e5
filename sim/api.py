"""Run a scenario: the one entry point the CLI, sweeps, fuzzing and notebooks share."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from sim.check import StepChecker
from sim.check.registry import LAUNCH_ORDER
from sim.config import Scenario, load_scenario, parse_scenario
from sim.engine import Engine
from sim.profiles import Switches, resolve_profile
from sim.trace.records import BlockEvent, RowRecord, StepRecord, Violation
from sim.trace.schema import ROW_OF, SCHEMAS
from sim.trace.writer import TraceWriter
from sim.workload import iter_workload

__all__ = ["RunResult", "load_scenario", "parse_scenario", "run", "switches_for"]


def kvsim_version() -> str:
    try:
        return importlib.metadata.version("kvsim")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass
class RunResult:
    summary: dict
    violations: list[Violation]
    steps: pa.Table
    requests: pa.Table
    kv_series: pa.Table
    trace_dir: Path | None = None
    switches: Switches = field(default_factory=Switches)


def switches_for(sc: Scenario, profile: str | None = None,
                 overrides: dict[str, object] | None = None) -> tuple[str, Switches]:
    name = profile or sc.profile
    return name, resolve_profile(name, {**sc.switches, **(overrides or {})})


class _Sink:
    """Receives each step once it is complete: trace writer, online checker, in-memory tables."""

    def __init__(self, sc: Scenario, writer: TraceWriter | None, checker: StepChecker | None,
                 progress: Callable[[int], None] | None) -> None:
        self.writer, self.checker, self.progress = writer, checker, progress
        self.B = sc.cache.tokens_per_block
        self.steps: list[tuple] = []
        self.kv: list[tuple[int, int, float, int]] = []
        self.violations: list[Violation] = []

    def __call__(self, step: StepRecord, rows: list[RowRecord], events: list[BlockEvent]) -> None:
        if self.writer is not None:
            self.writer.on_step(step, rows, events)
        if self.checker is not None:
            self._check(step, rows, events)
        self.steps.append(ROW_OF["steps"](step))
        spare = sum(r.reserved - r.committed - r.new_tokens for r in rows) / self.B
        self.kv.append((step.t_launch_ns, step.blocks_used, spare, step.blocks_cached))
        if self.progress is not None and step.step % 2048 == 0:
            self.progress(step.step)

    def _check(self, step: StepRecord, rows: list[RowRecord], events: list[BlockEvent]) -> None:
        ck = self.checker
        assert ck is not None
        out = self.violations
        for e in events:
            if e.phase == "sched":
                out.extend(ck.block_event(e))
        out.extend(ck.launch(step, rows))
        for e in events:
            if e.phase == "proc":
                out.extend(ck.block_event(e))


def _model_info(sc: Scenario, sw: Switches) -> dict:
    m = sc.model
    return {"num_q_heads": m.num_q_heads, "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "tokens_per_block": sc.cache.tokens_per_block, "num_blocks": sc.cache.num_blocks,
            "dtype": m.dtype, "max_position_embeddings": m.max_position_embeddings,
            "null_block": sw.null_block, "max_draft_len": sc.spec.depth,
            "blocks_per_seq": sc.blocks_per_seq}




def run(sc: Scenario, *, out: Path | None = None, check: bool = True, progress: bool = False,
        profile: str | None = None, switches: dict[str, object] | None = None,
        base_dir: Path | None = None, on_progress: Callable[[int], None] | None = None
        ) -> RunResult:
    """Simulate `sc`; write a trace to `out` if given; check invariants online if `check`."""
    name, sw = switches_for(sc, profile, switches)
    model = _model_info(sc, sw)
    rng = np.random.default_rng(np.random.SeedSequence(sc.seed).spawn(4)[3])
    specs = iter_workload(sc.workload, rng, tokens_per_block=sc.cache.tokens_per_block,
                          base_dir=base_dir)
    writer = TraceWriter(out) if out is not None else None
    sink = _Sink(sc, writer, StepChecker(model) if check else None, on_progress)
    try:
        detail = writer is not None or check
        eng = Engine(sc, sw, specs, sink, record_events=detail, detail=detail)
        eng.run()
        if sink.checker is not None:
            sink.violations.extend(sink.checker.finish())
        violations = sorted(eng.proc.violations + sink.violations, key=_order)
        summary = _summary(eng, sink, violations)
        trace_dir = None
        if writer is not None:
            manifest = {"kvsim_version": kvsim_version(), "scenario": sc.model_dump(mode="json"),
                        "profile": {"name": name, "switches": _sw_dict(sw)}, "seed": sc.seed,
                        "model": model, "summary": summary}
            trace_dir = writer.close(eng.proc.records, violations, manifest)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return RunResult(summary, violations, _table("steps", sink.steps),
                     _table("requests", [ROW_OF["requests"](r) for r in eng.proc.records]),
                     _kv_table(sink.kv), trace_dir, sw)


_RANK = {inv: i for i, inv in enumerate(("I19", "LIVENESS") + LAUNCH_ORDER + ("I17", "I18"))}


def _order(v: Violation) -> tuple[int, int, int]:
    """Step first, then the checker's order, in which the first invariant is the root cause."""
    return v.step, _RANK.get(v.invariant, len(_RANK)), v.request


def _sw_dict(sw: Switches) -> dict:
    from dataclasses import asdict
    return asdict(sw)


def _table(name: str, rows: list[tuple]) -> pa.Table:
    schema = SCHEMAS[name]
    cols: list = list(zip(*rows, strict=True)) if rows else [[] for _ in schema]
    return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(cols, schema,
                                                                          strict=True)],
                                schema=schema)


def _kv_table(rows: list[tuple[int, int, float, int]]) -> pa.Table:
    cols: list = list(zip(*rows, strict=True)) if rows else [[], [], [], []]
    return pa.table({"t_ns": pa.array(cols[0], pa.int64()),
                     "blocks_used": pa.array(cols[1], pa.int64()),
                     "blocks_reserved_draft": pa.array(cols[2], pa.float64()),
                     "blocks_cached": pa.array(cols[3], pa.int64())})


def _summary(eng: Engine, sink: _Sink, violations: list[Violation]) -> dict:
    recs = eng.proc.records
    gen_steps = sum(r.num_steps for r in recs)
    acc = sum(r.accepted_drafts for r in recs)
    prop = sum(r.proposed_drafts for r in recs)
    return {
        "requests": len(recs),
        "finished": sum(r.finish_reason in ("length", "max_seq_len") for r in recs),
        "rejected": sum(r.finish_reason == "rejected" for r in recs),
        "steps": eng.step,
        "output_tokens": sum(len(r.output_tokens) for r in recs),
        "prompt_tokens": sum(r.prompt_len for r in recs),
        "reused_tokens": sum(r.reused_tokens for r in recs),
        "acceptance_rate": acc / prop if prop else 0.0,
        "mean_accepted_len": 1 + acc / gen_steps if gen_steps else 0.0,
        "preemptions": sum(r.num_preemptions for r in recs),
        "peak_kv_blocks": max((s[13] for s in sink.steps), default=0),
        "num_blocks": eng.kv.pool.num_usable,
        "violations": len(violations),
        "sim_time_ns": eng.env.now,
    }
