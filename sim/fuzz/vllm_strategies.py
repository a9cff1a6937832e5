"""Hypothesis strategies for workloads vLLM 0.33.0's real scheduler can run (`--engine vllm`).

Only what the adapter expresses (docs/vllm.md, "Refused"): profile `vllm-v1`, reuse `off` or
`full`, no `[switches]`, no `scheduler.policy`, overlap off, EAGLE-style drafts of k = 1..4
with a forced acceptance list, no `runtime_draft_lens` or `extra_kv_tokens`. The knobs are
drawn relative to each other, as in sim/fuzz/strategies.py, and to vLLM's own start-up rules:

- the pool holds one request of `limits.max_seq_len` besides the null block (EngineCore
  refuses to start otherwise), and little more, so several requests preempt each other;
- `max_num_tokens` >= `max_batch_size` and `chunk_size` <= `max_seq_len` (SchedulerConfig's
  checks in vllm/config/scheduler.py, `verify_max_model_len`), and `chunk_size` >= 1 + k
  (below it vLLM 0.33.0 fails an assertion: docs/vllm.md; both engines refuse it).

Shrinking order: one request, no drafts, reuse off, default budgets, all arrivals at 0.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from sim.fuzz.strategies import _prompt_of, request_list

# vLLM's attention backends take these; 16 (its default) shrinks first.
BLOCK_SIZES = (16, 4, 8, 1, 2, 32)


@st.composite
def vllm_spec(draw: st.DrawFn) -> dict[str, Any]:
    k = draw(st.integers(0, 4))
    if not k:
        return {"mode": "none"}
    one = st.one_of(st.sampled_from((0, k)), st.integers(0, k))
    return {"mode": "mtp", "max_draft_len": k,
            "acceptance": {"kind": "forced",
                           "accepted": draw(st.lists(one, min_size=1, max_size=4))}}


def _budgets(draw: st.DrawFn, b: int, w: int, limit: int) -> dict[str, Any]:
    """Batch and token budgets; a small token budget splits prefills and defers decodes."""
    out: dict[str, Any] = {}
    seqs = draw(st.sampled_from((8, 1, 2, 3, 4)))
    if seqs != 8:
        out["max_batch_size"] = seqs
    if draw(st.booleans()):
        # kvsim asks for one decode step's tokens (1 + k) in the budget
        out["max_num_tokens"] = draw(st.integers(max(seqs, w), 4 * b + 8))
    if draw(st.booleans()):
        # vLLM's long_prefill_token_threshold: at most max_model_len, and at least 1 + k (below
        # it vLLM 0.33.0 fails an assertion, docs/vllm.md; both engines refuse it)
        side = draw(st.sampled_from((b, 2 * b, max(1, b - 1), b + 1)))
        out["chunk_size"] = min(limit, max(w, side))
    return out


@st.composite
def vllm_scenario_dicts(draw: st.DrawFn, max_requests: int = 6) -> dict[str, Any]:
    """A whole vLLM-expressible scenario as a dict, with `profile = "vllm-v1"`."""
    b = draw(st.sampled_from(BLOCK_SIZES))
    spec = draw(vllm_spec())
    w = 1 + spec.get("max_draft_len", 0)
    reuse = draw(st.sampled_from(("off", "full")))
    reqs = draw(request_list(b, w, explicit_tokens=reuse == "full", max_requests=max_requests))
    longest = max(_prompt_of(r) + r["output_len"] for r in reqs)
    # max_model_len at or a little past the longest request: a longer one is not needed, and
    # the pool follows from it
    limit = max(w + 2, longest + draw(st.integers(0, 2 * w)))
    need = -(-limit // b)
    slack = draw(st.integers(0, 3)) if draw(st.booleans()) else draw(st.integers(0, 64))
    return {"seed": 0, "profile": "vllm-v1",
            "cache": {"tokens_per_block": b, "num_blocks": need + 1 + slack, "reuse": reuse},
            "scheduler": _budgets(draw, b, w, limit), "spec": spec,
            "overlap": {"enabled": False}, "limits": {"max_seq_len": limit},
            "model": {"max_position_embeddings": limit + draw(st.sampled_from((0, 0, 1, 4)))},
            "workload": {"requests": reqs}}
