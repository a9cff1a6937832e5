"""Hypothesis-generated vLLM scenarios: chunked prefill, shared prefixes, preemption pressure,
EAGLE with k = 1-4 drafts, batch and token budgets, all inside what the vLLM adapter takes
(profile vllm-v1, reuse off or full, the synchronous engine).

`generated(n)` draws n of them, seeded (hypothesis derandomized): the same n dicts every run.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

STEP_NS = 2_000  # about one step of the scenarios' cost model: arrivals land between steps
ALPHABET = st.sampled_from((1, 2, 3, 7))  # few tokens: prefixes are shared, blocks collide


@st.composite
def vllm_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    b = draw(st.sampled_from((4, 8, 16, 2, 1)))
    k = draw(st.integers(0, 4))
    n = draw(st.integers(1, 8))
    base = draw(st.lists(ALPHABET, min_size=6 * b, max_size=6 * b))
    reqs = []
    for i in range(n):
        plen = draw(st.integers(1, 6 * b))
        shared = draw(st.integers(0, plen))
        tail = draw(st.lists(ALPHABET, min_size=plen - shared, max_size=plen - shared))
        reqs.append({"arrival_ns": 0 if i == 0 else draw(st.integers(0, 30)) * STEP_NS,
                     "prompt_tokens": base[:shared] + tail,
                     "output_len": draw(st.integers(1, 24))})
    reqs.sort(key=lambda r: r["arrival_ns"])
    longest = max(len(r["prompt_tokens"]) + r["output_len"] for r in reqs)
    lim = max(k + 2, draw(st.sampled_from((longest + 1, longest + k + 2, 4 * longest))))
    # vLLM starts only when one request of max_seq_len fits besides the null block
    need = -(-lim // b) + 1
    sc: dict[str, Any] = {
        "seed": draw(st.integers(0, 1000)), "profile": "vllm-v1",
        "model": {"max_position_embeddings": lim},
        "cache": {"tokens_per_block": b, "num_blocks": need + draw(st.integers(0, 3 * need)),
                  "reuse": draw(st.sampled_from(("full", "off"))),
                  # vLLM's reset_prefix_cache, mostly while blocks are held (then a no-op)
                  "reset_prefix_cache_ns": draw(st.lists(
                      st.integers(0, 40).map(lambda t: t * STEP_NS), max_size=2))},
        "scheduler": {"max_batch_size": (seqs := draw(st.integers(1, 6))),
                      "max_num_tokens": draw(st.integers(max(1 + k, seqs), 8 * b + k + seqs)),
                      "chunk_size": min(_chunk(draw, b, k), lim)},
        "overlap": {"enabled": False},
        "limits": {"max_seq_len": lim},
        "cost": {"step_base_ns": 1000, "ns_per_token": 10, "ns_per_kv_token": 1},
        "workload": {"requests": reqs},
    }
    if k:
        acc: dict[str, Any] = draw(st.sampled_from((
            {"kind": "rates", "rates": [0.9, 0.6, 0.5, 0.3][:k]},
            {"kind": "forced", "accepted": [0, k, 1 % (k + 1)]})))
        sc["spec"] = {"mode": "mtp", "max_draft_len": k, "acceptance": acc,
                      "eagle_block_drop": draw(st.booleans())}
    return sc


def _chunk(draw: st.DrawFn, b: int, k: int) -> int:
    """vLLM's long_prefill_token_threshold; never below one speculative step (1 + k): vLLM
    0.33.0 then fails an assertion (docs/vllm.md, "What kvsim check finds in real vLLM")."""
    c = draw(st.sampled_from((0, b, 2 * b, b + 1, 3)))
    return max(c, 1 + k) if c else 0


def generated(n: int) -> list[dict[str, Any]]:
    """n scenario dicts, the same every run."""
    out: list[dict[str, Any]] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(vllm_scenarios())
    def collect(sc: dict[str, Any]) -> None:
        out.append(sc)

    collect()
    return out[:n]
