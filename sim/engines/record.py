"""`record`: run a scenario through the real vLLM scheduler and write it as a kvsim trace.

The trace has the contract of `kvsim run --out` (docs/trace.md), so `kvsim check`, `metrics`,
`timeline` and `replay` read it; every step is also checked as it is written (StepChecker),
and what fires is in the trace's violations table, as a run's would be.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from sim.api import kvsim_version
from sim.check import StepChecker
from sim.config import Scenario
from sim.engines.vllm import PINNED, VllmSession, payload, run_driver
from sim.engines.vllm_trace import Converter, request_records
from sim.profiles import resolve_profile
from sim.trace.records import RequestRecord, Violation
from sim.trace.writer import TraceWriter


@dataclass
class Recorded:
    summary: dict
    violations: list[Violation]
    trace_dir: Path


def model_info(sc: Scenario) -> dict:
    """The manifest's model: as `kvsim run` writes it (sim/api.py), with vLLM's null block."""
    m = sc.model
    return {"num_q_heads": m.num_q_heads, "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "tokens_per_block": sc.cache.tokens_per_block, "num_blocks": sc.cache.num_blocks,
            "dtype": m.dtype, "max_position_embeddings": m.max_position_embeddings,
            "null_block": True, "max_draft_len": sc.spec.depth,
            "blocks_per_seq": sc.blocks_per_seq}


def record(sc: Scenario, out: Path, base_dir: Path | None = None,
           where: str = "scenario", session: VllmSession | None = None) -> Recorded:
    """Drive vLLM with `sc` (already checked by `refuse_unsupported`) and write the trace;
    in `session`'s driver process when given, else in one of its own.

    Raises VllmEnvError (no or another vLLM), ScenarioError (vLLM will not start with this
    pool; `where` names the scenario), KvsimError (the driver failed); nothing is left at
    `out` then (the writer's temporary directory is removed).
    """
    p = payload(sc, base_dir, where=where)
    model = model_info(sc)
    B = sc.cache.tokens_per_block
    conv = Converter(B, sc.cache.num_blocks, min(sc.model.max_position_embeddings,
                                                 sc.blocks_per_seq * B))
    checker = StepChecker(model)
    writer = TraceWriter(out)
    try:
        stream = _Stream(session.run(p) if session is not None else run_driver(p))
        violations, steps, peak = _steps(stream, conv, checker, writer)
        violations += checker.finish()
        if stream.last is None or "requests" not in stream.last:
            raise RuntimeError("the vLLM driver ended without its requests report; "
                               "this is a bug in the adapter")
        reqs = request_records(p, stream.last)
        for r in reqs:
            writer.add("requests", r)
        summary = _summary(reqs, steps, peak, stream.preempted, sc, violations)
        manifest = {"kvsim_version": kvsim_version(), "scenario": sc.model_dump(mode="json"),
                    "profile": {"name": "vllm-v1",
                                "switches": asdict(resolve_profile("vllm-v1"))},
                    "seed": sc.seed, "model": model, "summary": summary,
                    "engine": {"name": "vllm", "version": PINNED}}
        trace_dir = writer.close(violations, manifest)
    except BaseException:
        writer.abort()
        raise
    return Recorded(summary, violations, trace_dir)


class _Stream:
    """The driver's objects, passed through; keeps the last (the requests report) and counts
    preemptions on the way."""

    def __init__(self, objs: Iterable[dict]) -> None:
        self.objs, self.preempted = objs, 0
        self.last: dict | None = None

    def __iter__(self) -> Iterator[dict]:
        for o in self.objs:
            self.last = o
            self.preempted += len(o.get("preempted", ()))
            yield o


def _steps(objs: Iterable[dict], conv: Converter, checker: StepChecker,
           writer: TraceWriter) -> tuple[list[Violation], int, int]:
    """Write and check every step, in the checker's call order (sim/check/checker.py)."""
    violations: list[Violation] = []
    steps = peak = 0
    for step, rows, events in conv.steps(objs):
        writer.on_step(step, rows, events)
        for e in events:
            if e.phase == "sched":
                violations += checker.block_event(e)
        violations += checker.launch(step, rows)
        for e in events:
            if e.phase == "proc":
                violations += checker.block_event(e)
        steps += 1
        peak = max(peak, step.blocks_used)
    return violations, steps, peak


def _summary(reqs: list[RequestRecord], steps: int, peak: int, preempted: int, sc: Scenario,
             violations: list[Violation]) -> dict:
    done = [r for r in reqs if r.finish_reason in ("length", "max_seq_len")]
    proposed = sum(r.proposed_drafts for r in reqs)
    return {"requests": len(reqs), "finished": len(done),
            "rejected": sum(r.finish_reason == "rejected" for r in reqs), "steps": steps,
            "output_tokens": sum(len(r.output_tokens) for r in reqs),
            "prompt_tokens": sum(r.prompt_len for r in reqs),
            "reused_tokens": sum(r.reused_tokens for r in reqs),
            "acceptance_rate": (sum(r.accepted_drafts for r in reqs) / proposed
                                if proposed else 0.0),
            "preemptions": preempted, "peak_kv_blocks": peak,
            "num_blocks": sc.cache.num_blocks - 1, "violations": len(violations),
            "sim_time_ns": max((r.finish_ns for r in reqs), default=0)}
