"""Run a scenario: the one entry point the CLI, sweeps, fuzzing and notebooks share."""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sim.check import StepChecker
from sim.check.compiled import CompiledChecker
from sim.check.compiled.records import feed_records
from sim.check.registry import causal_key
from sim.config import Scenario, load_scenario, parse_scenario
from sim.engine import Engine
from sim.engines.vllm_model import is_vllm_model, run_vllm_model
from sim.errors import ProfileError, ScenarioError
from sim.fast import Chunk, FastEngine, StepStream, request_records, supports
from sim.metrics import LatencyTally
from sim.profiles import Switches, resolve_profile
from sim.trace.records import BlockEvent, RequestRecord, RowRecord, StepRecord, Violation
from sim.trace.schema import ROW_OF, SCHEMAS
from sim.trace.writer import TraceWriter, from_numpy, to_arrow
from sim.workload import RequestSpec, open_workload, stand_in
from sim.workload.source import stood_in

__all__ = ["RunResult", "load_scenario", "parse_scenario", "run", "switches_for"]

_CHECK_BATCH = 4096  # rows (+ steps) of reference-engine records per compiled-checker call


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
    workload: dict = field(default_factory=dict)  # where the requests came from (source.py)


def switches_for(sc: Scenario, profile: str | None = None,
                 overrides: dict[str, object] | None = None) -> tuple[str, Switches]:
    name = profile or sc.profile
    sw = resolve_profile(name, {**sc.switches, **(overrides or {})})
    _supported(sc, sw, name)
    return name, sw


class _Sink:
    """Receives each step once it is complete: trace writer, online checker, in-memory tables.

    With `collect=False` nothing per step or per request is kept (bounded memory for runs of
    millions of requests); the summary is built from running totals either way.
    """

    def __init__(self, sc: Scenario, writer: TraceWriter | None, checker: StepChecker | None,
                 progress: Callable[[int], None] | None, collect: bool,
                 compiled: CompiledChecker | None = None) -> None:
        self.writer, self.checker, self.progress, self.collect = writer, checker, progress, collect
        self.compiled = compiled
        self.B = sc.cache.tokens_per_block
        self.steps: list[tuple] = []
        self.kv: list[tuple[int, int, float, int]] = []
        self.requests: list[RequestRecord] = []
        self.violations: list[Violation] = []
        self.peak_blocks = 0
        self.latency = LatencyTally()  # the summary's TTFT/TPOT, kept even without `collect`
        self.stream = StepStream()
        self.pending: list[tuple[StepRecord, list[RowRecord], list[BlockEvent]]] = []
        self.pending_rows = 0

    def __call__(self, step: StepRecord, rows: list[RowRecord], events: list[BlockEvent]) -> None:
        if self.writer is not None:
            self.writer.on_step(step, rows, events)
        if self.checker is not None:
            self._check(step, rows, events)
        if self.compiled is not None:  # checked in batches of steps, one compiled call each
            self.pending.append((step, rows, events))
            self.pending_rows += len(rows) + 1
            if self.pending_rows >= _CHECK_BATCH:
                self.flush_records()
        self.peak_blocks = max(self.peak_blocks, step.blocks_used)
        if self.collect:
            self.steps.append(ROW_OF["steps"](step))
            spare = sum(r.reserved - r.committed - r.new_tokens for r in rows) / self.B
            self.kv.append((step.t_launch_ns, step.blocks_used, spare, step.blocks_cached))
        if self.progress is not None and step.step % 2048 == 0:
            self.progress(step.step)

    def flush_records(self) -> None:
        if self.compiled is not None:
            feed_records(self.compiled, self.pending)
        self.pending, self.pending_rows = [], 0

    def on_chunk(self, ch: Chunk) -> None:
        """The fast engine's output: columns straight to the trace; records only for the
        checker and the in-memory tables."""
        if self.writer is not None:
            self.writer.add_columns("steps", ch.steps)
            if ch.rows:
                self.writer.add_columns("rows", ch.rows, encoded=ch.rows_encoded,
                                        keep=ch.rows_encoded)
            self.writer.add_columns("blocks", ch.blocks, keep=ch.rows_encoded)
            self.writer.add_columns("requests", ch.requests)
        used = ch.steps["blocks_used"]
        if len(used):
            self.peak_blocks = max(self.peak_blocks, int(used.max()))
        if self.compiled is not None:
            self.compiled.feed(ch.steps, ch.rows, ch.blocks)
        if self.checker is not None:
            for step, rows, events in self.stream.feed(ch):
                self._step_records(step, rows, events)
        elif self.collect:  # the tables need no row records: straight from the columns
            st = ch.steps
            self.steps.extend(zip(*(st[f].tolist() for f in st), strict=True))
            self.kv.extend(zip(st["t_launch_ns"].tolist(), st["blocks_used"].tolist(),
                               (ch.spare_slots / self.B).tolist(),
                               st["blocks_cached"].tolist(), strict=True))
        rq = ch.requests
        n_out = np.diff(rq["output_tokens"][0])  # type: ignore[index]
        done = pc.is_in(rq["finish_reason"], pa.array(["length", "max_seq_len"]))
        self.latency.add(rq["arrival_ns"], rq["first_token_ns"], rq["finish_ns"],  # type: ignore[arg-type]
                         n_out, done.to_numpy(zero_copy_only=False))
        if self.collect:
            self.requests.extend(request_records(ch))
        steps = ch.steps["step"]
        if self.progress is not None and len(steps):
            self.progress(int(steps[-1]))

    def finish_chunks(self) -> None:
        for step, rows, events in self.stream.finish():
            self._step_records(step, rows, events)

    def _step_records(self, step: StepRecord, rows: list[RowRecord],
                      events: list[BlockEvent]) -> None:
        if self.checker is not None:
            self._check(step, rows, events)
        if self.collect:
            self.steps.append(ROW_OF["steps"](step))
            spare = sum(r.reserved - r.committed - r.new_tokens for r in rows) / self.B
            self.kv.append((step.t_launch_ns, step.blocks_used, spare, step.blocks_cached))

    def on_request(self, rec: RequestRecord) -> None:
        self.latency.add_record(rec)
        if self.writer is not None:
            self.writer.add("requests", rec)
        if self.collect:
            self.requests.append(rec)

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


def _specs(sc: Scenario, base_dir: Path | None) -> tuple[Iterator[RequestSpec], dict]:
    """The requests and the record of their source (sim/workload/source.py)."""
    rng = np.random.default_rng(np.random.SeedSequence(sc.seed).spawn(4)[3])
    return open_workload(sc.workload, rng, tokens_per_block=sc.cache.tokens_per_block,
                         base_dir=base_dir)


def _worded(sc: Scenario, sw: Switches, model: dict, base_dir: Path | None, fast: bool,
            found: list[tuple[str, int, int]], vllm: bool = False) -> list[Violation]:
    """The compiled checker found violations: run again (the same run: deterministic) through
    StepChecker, the oracle, for their messages. A run that violates nothing never gets here."""
    sink = _Sink(sc, None, StepChecker(model), None, collect=False)
    if vllm:
        run_vllm_model(sc, base_dir, sink)
    elif fast:
        FastEngine(sc, sw, _specs(sc, base_dir)[0], sink.on_chunk, detail=True).run()
        sink.finish_chunks()
    else:
        Engine(sc, sw, _specs(sc, base_dir)[0], sink, record_events=True, detail=True).run()
    assert sink.checker is not None
    out = sink.violations + sink.checker.finish()
    if [(v.invariant, v.step, v.request) for v in out] != found:
        warnings.warn(CheckerDisagreement(
            f"the compiled checker found {found[:3]}... ({len(found)}) but StepChecker "
            f"{[(v.invariant, v.step, v.request) for v in out[:3]]}... ({len(out)}); "
            "StepChecker's are reported. Please report this kvsim bug."), stacklevel=3)
    return out


class CheckerDisagreement(RuntimeWarning):
    """The compiled checker and StepChecker disagree on a run: a kvsim bug."""


def _model_info(sc: Scenario, sw: Switches) -> dict:
    m = sc.model
    return {"num_q_heads": m.num_q_heads, "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "tokens_per_block": sc.cache.tokens_per_block, "num_blocks": sc.cache.num_blocks,
            "dtype": m.dtype, "max_position_embeddings": m.max_position_embeddings,
            "null_block": sw.null_block, "max_draft_len": sc.spec.depth,
            "blocks_per_seq": sc.blocks_per_seq}




def run(sc: Scenario, *, out: Path | None = None, check: bool = True, progress: bool = False,
        profile: str | None = None, switches: dict[str, object] | None = None,
        base_dir: Path | None = None, on_progress: Callable[[int], None] | None = None,
        collect: bool = True, engine: str = "auto", synthetic_workload: bool = False
        ) -> RunResult:
    """Simulate `sc`; write a trace to `out` if given; check invariants online if `check`.

    `collect=False` keeps no per-step/per-request tables in memory (RunResult's tables are
    empty; the summary and the trace are complete). `engine`: "reference" (sim/engine.py),
    "fast" (sim/fast: compiled, a subset of scenarios, the same trace) or "auto" (fast where
    it supports the scenario). `synthetic_workload`: run a trace scenario's
    `workload.trace.fallback` instead of its trace file (the manifest says so)."""
    trace = sc.workload.trace
    if synthetic_workload:
        sc = sc.model_copy(update={"workload": stand_in(sc.workload)})
    name, sw = switches_for(sc, profile, switches)
    vllm = is_vllm_model(name, switches, engine)
    fast = not vllm and _pick_engine(engine, sc, sw)
    model = _model_info(sc, sw)
    specs, source = _specs(sc, base_dir)
    if synthetic_workload and trace is not None:
        source = stood_in(source, trace)
    writer = None
    try:
        writer = TraceWriter(out) if out is not None else None
        # the compiled checker finds; StepChecker words what it finds (docs/checking.md)
        compiled = CompiledChecker(model) if check else None
        sink = _Sink(sc, writer, None, on_progress, collect, compiled)
        detail = writer is not None or check
        if vllm:
            state = run_vllm_model(sc, base_dir, sink)
            raised = []
        elif fast:
            # without the checker, only the writer takes the rows: stored as they go on disk
            feng = FastEngine(sc, sw, specs, sink.on_chunk, detail, delta=not check)
            feng.run()
            sink.finish_chunks()
            raised = feng.violations
            state = (feng.totals, feng.step, feng.num_usable, feng.now)
        else:
            eng = Engine(sc, sw, specs, sink, record_events=detail, detail=detail)
            eng.proc.on_request = sink.on_request
            eng.run()
            raised = eng.proc.violations
            state = (eng.proc.totals, eng.step, eng.kv.pool.num_usable, int(eng.env.now))
        sink.flush_records()
        if compiled is not None and (found := compiled.finish()):
            sink.violations = _worded(sc, sw, model, base_dir, fast, found, vllm)
        violations = sorted(raised + sink.violations, key=causal_key)
        summary = _summary(*state, sink, violations)
        summary |= {"engine": "vllm-model" if vllm else "fast" if fast else "reference",
                    "profile": name}
        trace_dir = None
        if writer is not None:
            manifest = {"kvsim_version": kvsim_version(), "scenario": sc.model_dump(mode="json"),
                        "profile": {"name": name, "switches": _sw_dict(sw)}, "seed": sc.seed,
                        "model": model, "summary": summary, "workload": source}
            trace_dir = writer.close(violations, manifest)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return RunResult(summary, violations, _table("steps", sink.steps),
                     _table("requests", [ROW_OF["requests"](r) for r in
                                         sorted(sink.requests, key=lambda x: x.request)]),
                     _kv_table(sink.kv), trace_dir, sw, source)


def _supported(sc: Scenario, sw: Switches, name: str) -> None:
    """Combinations a profile's engine does not have are input errors, not false alarms."""
    if name.split("+")[0] != "vllm-v1":
        for field, on in (("cache.reset_prefix_cache_ns", sc.cache.reset_prefix_cache_ns),
                          ("spec.eagle_block_drop", sc.spec.eagle_block_drop)):
            if on:
                raise ProfileError(f"{field}: a vLLM behaviour; profile {name!r} is not vLLM "
                                   "(use profile vllm-v1)")
    if sc.spec.mode == "mtp" and sc.spec.extra_kv_tokens and sw.gen_table_width != "reserved":
        raise ProfileError(
            f"spec.extra_kv_tokens = {sc.spec.extra_kv_tokens} needs a generation page table that "
            f"exposes the reserved pages (gen_table_width = reserved); profile {name!r} sizes "
            f"rows to the logical length ({sw.gen_table_width}), so draft-layer KV has nowhere "
            "to go (vLLM keeps draft KV in its own cache group)")


def _sw_dict(sw: Switches) -> dict:
    return asdict(sw)


def _table(name: str, rows: list[tuple]) -> pa.Table:
    schema = SCHEMAS[name]
    cols: list = list(zip(*rows, strict=True)) if rows else [[] for _ in schema]
    return pa.Table.from_arrays([to_arrow(c, f.type) for c, f in zip(cols, schema, strict=True)],
                                schema=schema)


def _kv_table(rows: list[tuple[int, int, float, int]]) -> pa.Table:
    """The KV series; built from numpy buffers (pa.array's first call imports pandas, ~0.15 s
    that a traced run otherwise never pays)."""
    cols: list = list(zip(*rows, strict=True)) if rows else [[], [], [], []]
    types = {"t_ns": (np.int64, pa.int64()), "blocks_used": (np.int64, pa.int64()),
             "blocks_reserved_draft": (np.float64, pa.float64()),
             "blocks_cached": (np.int64, pa.int64())}
    return pa.table({name: from_numpy(np.array(c, dt), t)
                     for (name, (dt, t)), c in zip(types.items(), cols, strict=True)})


def _pick_engine(engine: str, sc: Scenario, sw: Switches) -> bool:
    """True: run the fast engine."""
    if engine == "reference":
        return False
    why = supports(sc, sw)
    if engine == "fast" and why is not None:
        raise ScenarioError(f"--engine fast: this scenario needs the reference engine ({why})")
    if engine not in ("auto", "fast"):
        raise ScenarioError(f"engine must be auto, fast or reference, not {engine!r}")
    return why is None


def _summary(t: dict, steps: int, num_usable: int, now: int, sink: _Sink,
             violations: list[Violation]) -> dict:
    return {
        "requests": t["requests"],
        "finished": t["finished"],
        "rejected": t["rejected"],
        "steps": steps,
        "output_tokens": t["output_tokens"],
        "prompt_tokens": t["prompt_tokens"],
        "reused_tokens": t["reused_tokens"],
        "acceptance_rate": t["accepted"] / t["proposed"] if t["proposed"] else 0.0,
        "mean_accepted_len": 1 + t["accepted"] / t["gen_steps"] if t["gen_steps"] else 0.0,
        "preemptions": t["preemptions"],
        "peak_kv_blocks": sink.peak_blocks,
        "num_blocks": num_usable,
        "violations": len(violations),
        "sim_time_ns": now,
    } | sink.latency.summary(t["output_tokens"])
