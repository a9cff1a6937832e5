"""The compiled checker (sim/check/compiled) against its oracle, StepChecker.

On the same run both must report the same (invariant, step, request) of every violation, in
StepChecker's order: traces of every repository scenario (faults included, which fire every
kind of violation), hypothesis-drawn scenarios under every profile and fault, and the fast
engine's chunks fed straight in through buffers small enough that a step's events straddle
two chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import sim.fast.engine as fast_engine
from sim.api import _model_info, load_scenario, parse_scenario, run, switches_for
from sim.check import StepChecker
from sim.check.compiled import CompiledChecker, check_trace_compiled, warm
from sim.check.offline import check_trace
from sim.config import Scenario
from sim.errors import ProfileError, ScenarioError
from sim.fast import Chunk, FastEngine, StepStream
from sim.fuzz.strategies import fast_scenario_dicts, scenario_dicts
from sim.profiles import FAULTS, PROFILES
from sim.trace.reader import Trace, iter_records, read_trace
from sim.trace.records import BlockEvent
from sim.trace.schema import SCHEMAS
from sim.workload import iter_workload

ROOT = Path(__file__).resolve().parents[2]
SMALL = 40  # requests kept from a scenario: enough to batch, preempt and reuse

Triple = tuple[str, int, int]


def _small(sc: Scenario) -> Scenario:
    """At most SMALL requests, whichever source the workload has."""
    wl = sc.workload
    if wl.requests is not None:
        wl = wl.model_copy(update={"requests": wl.requests[:SMALL]})
    elif wl.synthetic is not None:
        n = min(wl.synthetic.num_requests, SMALL)
        wl = wl.model_copy(update={"synthetic": wl.synthetic.model_copy(
            update={"num_requests": n})})
    elif wl.trace is not None:
        tr = wl.trace.model_copy(update={"limit": min(wl.trace.limit or SMALL, SMALL)})
        if tr.fallback is not None:
            tr = tr.model_copy(update={"fallback": tr.fallback.model_copy(
                update={"num_requests": min(tr.fallback.num_requests, SMALL)})})
        wl = wl.model_copy(update={"trace": tr})
    return sc.model_copy(update={"workload": wl})


def _both(trace_dir: Path) -> tuple[list[Triple], list[Triple]]:
    oracle = [(v.invariant, v.step, v.request) for v in check_trace(trace_dir)]
    return oracle, check_trace_compiled(trace_dir)


def _traced(sc: Scenario, profile: str | None, tmp: Path, base: Path | None = None) -> Path:
    out = tmp / "trace"
    try:
        run(sc, out=out, check=False, collect=False, profile=profile, base_dir=base)
    except ScenarioError as e:
        if (profile or sc.profile).split("+")[0] == "vllm-v1":  # vLLM lacks the feature
            raise _VllmRefusal(str(e)) from e
        raise
    return out


# -- the repository's scenarios ------------------------------------------------------------
def _catalog() -> Iterator[tuple[str, str | None]]:
    for p in sorted((ROOT / "scenarios").glob("*.toml")):
        for profile in PROFILES:
            yield str(p.relative_to(ROOT)), profile
    for name in sorted(FAULTS):
        yield f"scenarios/faults/{name}.toml", f"trtllm-post-17264+{name}"
    for p in sorted((ROOT / "tests" / "regressions").glob("*.toml")):
        yield str(p.relative_to(ROOT)), None  # the fixed profile the file names


class _VllmRefusal(ScenarioError):
    """Never raised: stands for the ScenarioError profile vllm-v1 raises on a TensorRT-LLM
    feature (see `_traced`)."""


def _check_case(rel: str, profile: str | None, tmp: Path) -> list[Triple]:
    sc, base = load_scenario(ROOT / rel)
    try:
        switches_for(sc, profile)
        trace = _traced(_small(sc), profile, tmp, base)
    except (ProfileError, _VllmRefusal):
        pytest.skip(f"{profile} does not model {rel}")
    oracle, compiled = _both(trace)
    assert compiled == oracle
    return oracle


@pytest.mark.parametrize(("rel", "profile"), [c for c in _catalog() if "faults/" not in c[0]])
def test_scenarios_match_the_oracle(rel, profile, tmp_path):
    _check_case(rel, profile, tmp_path)


def test_fault_catalog_matches_and_fires_most_invariants(tmp_path):
    """Each catalog fault fires violations; together they cover most invariant ids, so the
    equality above cannot hold vacuously."""
    seen: set[str] = set()
    for rel, profile in _catalog():
        if "faults/" in rel:
            found = _check_case(rel, profile, tmp_path / rel.replace("/", "_"))
            seen |= {inv for inv, _, _ in found}
    assert len(seen) >= 12, sorted(seen)
    assert {"I10", "I17", "I5", "I11", "I14", "I16", "I2", "I1"} <= seen, sorted(seen)


# -- hypothesis: every profile, every fault --------------------------------------------------
_PROFILES = st.one_of(st.sampled_from(sorted(PROFILES)),
                      st.tuples(st.sampled_from(sorted(PROFILES)), st.sampled_from(sorted(FAULTS)))
                      .map("+".join))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(d=scenario_dicts(), profile=_PROFILES)
def test_fuzzed_scenarios_match_the_oracle(tmp_path_factory, d, profile):
    sc = parse_scenario({**d, "profile": profile.split("+")[0]})
    try:
        switches_for(sc, profile)
        trace = _traced(sc, profile, tmp_path_factory.mktemp("fz"))
    except (ProfileError, _VllmRefusal):
        assume(False)
    oracle, compiled = _both(trace)
    assert compiled == oracle


# -- the fast engine's chunks, fed directly ---------------------------------------------------
def _chunk_run(sc: Scenario, profile: str | None = None,
               base: Path | None = None) -> tuple[list[Triple], list[Triple]]:
    """StepChecker through StepStream (as sim.api's sink) and CompiledChecker, fed the same
    chunks of one fast-engine run."""
    _, sw = switches_for(sc, profile)
    model = _model_info(sc, sw)
    oracle, stream, ck = StepChecker(model), StepStream(), CompiledChecker(model)
    got: list = []

    def step(s, rows, events) -> None:  # type: ignore[no-untyped-def]
        got.extend(oracle.block_event(e) for e in events if e.phase == "sched")
        got.append(oracle.launch(s, rows))
        got.extend(oracle.block_event(e) for e in events if e.phase == "proc")

    def on_chunk(ch: Chunk) -> None:
        ck.feed(ch.steps, ch.rows, ch.blocks)
        for item in stream.feed(ch):
            step(*item)

    rng = np.random.default_rng(np.random.SeedSequence(sc.seed).spawn(4)[3])
    specs = iter_workload(sc.workload, rng, tokens_per_block=sc.cache.tokens_per_block,
                          base_dir=base)
    FastEngine(sc, sw, specs, on_chunk, detail=True).run()
    for item in stream.finish():
        step(*item)
    got.append(oracle.finish())
    return [(v.invariant, v.step, v.request) for vs in got for v in vs], ck.finish()


def test_fast_engine_chunks_straddling_steps(monkeypatch):
    monkeypatch.setattr(fast_engine, "_STEPS", 7)
    sc, base = load_scenario(ROOT / "bench" / "workloads" / "a_vidur.toml")
    sc = _small(sc).model_copy(update={"cache": sc.cache.model_copy(update={"num_blocks": 400})})
    for profile in PROFILES:
        oracle, compiled = _chunk_run(sc, profile, base)
        assert compiled == oracle


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(d=fast_scenario_dicts(max_requests=6), data=st.data())
def test_fuzzed_fast_engine_chunks_match_the_oracle(d, data):
    steps = data.draw(st.sampled_from((3, 7, 4096)))
    old = fast_engine._STEPS
    fast_engine._STEPS = steps  # hypothesis and function-scoped monkeypatch do not mix
    try:
        oracle, compiled = _chunk_run(parse_scenario(d))
    finally:
        fast_engine._STEPS = old
    assert compiled == oracle


def test_warm_is_idempotent():
    warm()
    warm()


# -- corrupted traces: the rare paths (POOL, I6, repeats, stray events, odd backends) ---------
_SOURCES = ("uncorrected_overlap", "append_into_shared", "double_free", "device_ahead_overrun",
            "free_in_flight")
_traces: dict[str, tuple[dict, dict[str, dict[str, np.ndarray]]]] = {}


def _columns_of(name: str, tmp: Path) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """A catalog fault's trace as numpy columns (lists as (offsets, values)), once per worker."""
    if name not in _traces:
        sc, base = load_scenario(ROOT / "scenarios" / "faults" / f"{name}.toml")
        tr = read_trace(_traced(sc, f"trtllm-post-17264+{name}", tmp, base))
        cols = {t: {f: _np(tr.tables[t].column(f)) for f in tr.tables[t].column_names}
                for t in ("steps", "rows", "blocks")}
        _traces[name] = (tr.manifest["model"], cols)
    return _traces[name]


def _np(col: pa.ChunkedArray) -> object:
    arr = col.combine_chunks()
    if pa.types.is_list(arr.type):
        return arr.offsets.to_numpy().copy(), arr.values.to_numpy().copy()
    return arr.to_numpy(zero_copy_only=False).copy()


def _table(name: str, cols: dict) -> pa.Table:
    arrays = []
    for f in SCHEMAS[name]:
        v = cols[f.name]
        if pa.types.is_list(f.type):
            arrays.append(pa.ListArray.from_arrays(pa.array(v[0], pa.int32()),
                                                   pa.array(v[1], pa.int32())))
        else:
            arrays.append(pa.array(v, f.type))
    return pa.Table.from_arrays(arrays, schema=SCHEMAS[name])


_MUTABLE = {
    "blocks": ("event", "block", "request", "refcount", "src", "num_tokens"),
    "rows": ("phase", "q_len", "first_gen", "prev_in_flight", "pages", "kv_indptr",
             "last_page_len", "kv_len", "append_pos", "rope_pos", "cached_host", "kv_len_host",
             "committed", "alloc", "reserved", "shared_blocks", "accepted", "prev_new_tokens",
             "max_pos"),
    "steps": ("backend", "plan_q_len", "plan_batch", "plan_cache_size", "blocks_used",
              "blocks_free", "graph_width"),
}
_WORDS = {"event": ("alloc", "reuse", "copy", "free", "evict", "rewind", "hash", "done", "x"),
          "phase": ("ctx", "gen", "sched", "proc", "x"), "backend": ("fa2", "fa3", "xqa", "x")}


def _mutate(table: str, cols: dict, field: str, rng: np.random.Generator, n: int) -> None:
    """n random entries of one column nudged to a nearby or odd value, in place."""
    v = cols[field]
    vals = v[1] if isinstance(v, tuple) else v
    if not len(vals):
        return
    idx = rng.integers(0, len(vals), n)
    if field in _WORDS or (field == "phase" and table == "blocks"):
        vals[idx] = rng.choice(np.array(_WORDS.get(field, ("sched", "proc")), dtype=object), n)
    elif vals.dtype == bool:
        vals[idx] = ~vals[idx]
    else:
        vals[idx] = np.where(rng.random(n) < 0.3, rng.integers(-1, 3, n),
                             vals[idx] + rng.integers(-2, 3, n))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(_SOURCES), seed=st.integers(0, 2**32 - 1),
       edits=st.lists(st.tuples(st.sampled_from(sorted(_MUTABLE)), st.integers(0, 99),
                                st.integers(1, 4)), min_size=1, max_size=6))
def test_corrupted_traces_match_the_oracle(tmp_path_factory, name, seed, edits):
    """Every column nudged somewhere: exactly the oracle's verdicts on any input, not only on
    traces an engine writes."""
    model, clean = _columns_of(name, tmp_path_factory.mktemp("src"))
    cols = _copy(clean)
    rng = np.random.default_rng(seed)
    for table, pick, n in edits:
        fields = _MUTABLE[table]
        _mutate(table, cols[table], fields[pick % len(fields)], rng, n)
    _compare_columns(model, cols)


@pytest.mark.parametrize(("inv", "name", "table", "field", "seed"), [
    ("POOL", "uncorrected_overlap", "blocks", "refcount", 0),
    ("I6", "uncorrected_overlap", "rows", "shared_blocks", 0),
    ("I20", "append_into_shared", "steps", "graph_width", 20),
    ("I4", "uncorrected_overlap", "rows", "pages", 1),
    ("I13", "uncorrected_overlap", "rows", "kv_len_host", 0),
])
def test_corruptions_fire_what_the_catalog_does_not(tmp_path, inv, name, table, field, seed):
    """Invariants no catalog fault fires first, made to fire: the equality is not vacuous."""
    model, clean = _columns_of(name, tmp_path)
    cols = _copy(clean)
    _mutate(table, cols[table], field, np.random.default_rng(seed), 3)
    assert inv in {v[0] for v in _compare_columns(model, cols)}


def _copy(clean: dict) -> dict:
    return {t: {f: (tuple(a.copy() for a in v) if isinstance(v, tuple) else v.copy())
                for f, v in c.items()} for t, c in clean.items()}


def _compare_columns(model: dict, cols: dict) -> list[Triple]:
    """StepChecker over the columns' records (iter_records order) == CompiledChecker fed them
    as one chunk; returns the triples."""
    trace = Trace(Path("."), {"model": model}, {t: _table(t, c) for t, c in cols.items()})
    oracle = StepChecker(model)
    want: list = []
    for item in iter_records(trace):
        want += (oracle.block_event(item) if isinstance(item, BlockEvent)
                 else oracle.launch(*item))
    want += oracle.finish()
    ck = CompiledChecker(model)
    ck.feed(cols["steps"], cols["rows"], cols["blocks"])
    triples = [(v.invariant, v.step, v.request) for v in want]
    assert ck.finish() == triples
    return triples
