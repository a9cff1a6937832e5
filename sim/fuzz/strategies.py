"""Hypothesis strategies for scenario dicts aimed at the scheduler's hard corners.

Every draw is a plain dict that `sim.config.parse_scenario` accepts (valid by construction, so
no example is wasted on a filter) and that `sim.fuzz.toml_out.dumps` can write back. The knobs
are drawn *relative to each other* — pool size from what one request needs, prompt lengths from
the block size and query width, the position limit from the longest prompt — because the
invariants break at those edges, not at random absolute values.

Shrinking order matters: hypothesis shrinks integers towards 0 and `sampled_from` towards its
first element, so each choice lists the shape a minimal reproduction usually has first (MTP on,
overlap on, one request, all requests arriving at once).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# 8 first: the smallest block size that still shows partial blocks clearly when shrunk.
BLOCK_SIZES = (8, 4, 16, 1, 2, 3, 32)
REUSE = ("off", "full", "partial-copy", "partial-nocopy")
POLICIES = ("guaranteed-no-evict", "max-utilization")
STEP_NS = 4_000_000  # about one simulated iteration: arrivals land between steps
# Tiny vocabulary: prefixes collide, so reuse (full and partial) really happens.
ALPHABET = st.sampled_from((1, 2, 32, 33))


@st.composite
def spec_section(draw: st.DrawFn) -> dict[str, Any]:
    """MTP with forced acceptance sequences that include 0 (all rejected) and D (all taken)."""
    if not draw(st.sampled_from((True, False))):
        return {"mode": "none"}
    d = draw(st.integers(1, 4))
    one = st.one_of(st.sampled_from((0, d)), st.integers(0, d))
    spec: dict[str, Any] = {"mode": "mtp", "max_draft_len": d,
                            "acceptance": {"kind": "forced",
                                           "accepted": draw(st.lists(one, min_size=1,
                                                                     max_size=4))}}
    if draw(st.booleans()):  # runtime width changes: offsets of either sign under overlap
        spec["runtime_draft_lens"] = draw(st.lists(st.integers(0, d), min_size=1, max_size=3))
    if draw(st.booleans()):  # draft-layer KV past the W verified tokens
        spec["extra_kv_tokens"] = draw(st.integers(1, d))
    return spec


def _prompt_len(draw: st.DrawFn, b: int, w: int) -> int:
    """P = k*B + off with off in [-W, 0] half the time: the block-boundary corner."""
    k = draw(st.integers(1, 4))
    if draw(st.booleans()):
        off = draw(st.integers(-(b - 1), b - 1))
    else:
        off = -draw(st.integers(0, w))
    return max(1, k * b + off)


def _prompt_tokens(draw: st.DrawFn, base: list[int], length: int) -> list[int]:
    """A prefix of the shared base, then this request's own tail from the tiny alphabet."""
    shared = draw(st.integers(0, length))
    tail = draw(st.lists(ALPHABET, min_size=length - shared, max_size=length - shared))
    return base[:shared] + tail


@st.composite
def request_list(draw: st.DrawFn, b: int, w: int, explicit_tokens: bool,
                 max_requests: int = 4) -> list[dict[str, Any]]:
    n = draw(st.integers(1, max_requests))
    lens = [_prompt_len(draw, b, w) for _ in range(n)]
    base = draw(st.lists(ALPHABET, min_size=max(lens), max_size=max(lens)))
    out = []
    for i, p in enumerate(lens):
        req: dict[str, Any] = {"arrival_ns": 0 if i == 0 else
                               draw(st.integers(0, 12)) * STEP_NS}
        if explicit_tokens:
            req["prompt_tokens"] = _prompt_tokens(draw, base, p)
        else:
            req["prompt_len"] = p
        req["output_len"] = draw(st.integers(1, 32))
        out.append(req)
    out.sort(key=lambda r: r["arrival_ns"])  # stable: the order shrinking sees stays FCFS
    return out


def _prompt_of(req: dict[str, Any]) -> int:
    return int(req.get("prompt_len") or len(req["prompt_tokens"]))


@st.composite
def scenario_dicts(draw: st.DrawFn, max_requests: int = 4) -> dict[str, Any]:
    """A whole scenario as a dict (no `profile`: the campaign supplies it)."""
    b = draw(st.sampled_from(BLOCK_SIZES))
    spec = draw(spec_section())
    d = spec.get("max_draft_len", 0)
    w = 1 + d
    reuse = draw(st.sampled_from(REUSE))
    reqs = draw(request_list(b, w, explicit_tokens=reuse != "off", max_requests=max_requests))
    longest = max(_prompt_of(r) + r["output_len"] for r in reqs)
    sc: dict[str, Any] = {"seed": 0, "cache": {"tokens_per_block": b}, "spec": spec,
                          "overlap": {"enabled": draw(st.sampled_from((True, False)))}}
    limit = _limits(draw, sc, reqs, d)
    # Tight pool: just above one request's blocks to completion (with spec/overlap headroom),
    # so admission, reservation growth and eviction all run at the edge.
    one = -(-(min(longest, limit) + 2 * w + spec.get("extra_kv_tokens", 0)) // b) + 1
    roomy = draw(st.sampled_from((False, True)))
    slack = draw(st.integers(0, 64)) if roomy else draw(st.integers(-1, 3))
    sc["cache"].update({"num_blocks": max(2, one + slack), "reuse": reuse})
    sc["scheduler"] = _scheduler(draw, b)
    sc["workload"] = {"requests": reqs}
    return sc


def _limits(draw: st.DrawFn, sc: dict[str, Any], reqs: list[dict[str, Any]], d: int) -> int:
    """Half the time max_seq_len sits just past the longest prompt, with the RoPE table exactly
    that size (the Gemma4 shape) or a little larger. Returns the effective limit."""
    if not draw(st.booleans()):
        return 4096
    longest = max(_prompt_of(r) for r in reqs)
    lim = max(d + 2, longest + draw(st.integers(0, 2 * (1 + d) + 4)))
    sc["limits"] = {"max_seq_len": lim}
    sc["model"] = {"max_position_embeddings": lim + draw(st.sampled_from((0, 0, 1, 4)))}
    return lim


def _scheduler(draw: st.DrawFn, b: int) -> dict[str, Any]:
    out: dict[str, Any] = {"policy": draw(st.sampled_from(POLICIES))}
    if draw(st.booleans()):  # chunked prefill: chunks that end on and off block boundaries
        out["chunk_size"] = draw(st.sampled_from((b, 2 * b, max(1, b - 1), b + 1)))
    if draw(st.booleans()):
        out["max_batch_size"] = draw(st.integers(1, 4))
    return out


@st.composite
def fast_scenario_dicts(draw: st.DrawFn, max_requests: int = 4) -> dict[str, Any]:
    """scenario_dicts moved into the fast engine's subset (no MTP, overlap or reuse), under a
    random profile with random engine switches, faulty ones included: what tests hold the fast
    engine and the compiled checker to their oracles with."""
    d = draw(scenario_dicts(max_requests=max_requests))
    d.update(spec={"mode": "none"}, overlap={"enabled": False},
             profile=draw(st.sampled_from(("vllm-v1-legacy", "trtllm-post-17264",
                                           "trtllm-pre-17264"))))
    d["cache"]["reuse"] = "off"
    d["switches"] = {
        "backend": draw(st.sampled_from(("fa2", "fa3", "xqa"))),
        "gen_table_width": draw(st.sampled_from(("reserved", "logical-host", "logical-device"))),
        "plan_key": draw(st.sampled_from(("fresh", "no-width", "per-batch"))),
        "null_block": draw(st.booleans()),
        "draft_clamp": draw(st.booleans()),
    }
    if draw(st.booleans()):  # token budgets small enough to split prefill and defer rows
        d["scheduler"]["max_num_tokens"] = draw(st.integers(1, 64))
    return d
