"""Path labels and the search target, derived from one run's result.

The labels feed `hypothesis.event()` (its statistics and the campaign's "distinct paths" count:
a path is the set of labels one example hit). The target feeds `hypothesis.target()`, which
steers generation towards examples that score higher: pool pressure is what precedes most
reservation and admission failures.
"""

from __future__ import annotations

from typing import Any

from sim.api import RunResult


def path_labels(sc: dict[str, Any], res: RunResult) -> tuple[str, ...]:
    s = res.summary
    b = sc["cache"]["tokens_per_block"]
    w = 1 + sc["spec"].get("max_draft_len", 0)
    prompts = res.requests.column("prompt_len").to_pylist()
    reasons = set(res.requests.column("finish_reason").to_pylist())
    labels = [f"reuse={sc['cache'].get('reuse', 'partial-copy')}",
              f"spec={sc['spec']['mode']}", f"overlap={sc['overlap']['enabled']}"]
    flags = {
        "reuse hit": s["reused_tokens"] > 0,
        "preemption": s["preemptions"] > 0,
        "rejected": s["rejected"] > 0,
        "finish at max_seq_len": "max_seq_len" in reasons,
        "pool full": s["peak_kv_blocks"] >= s["num_blocks"],
        "prompt on block boundary": any(p % b == 0 for p in prompts),
        # within W of the next boundary: the first generation step crosses it
        "prompt crosses boundary in first step": any(0 < -p % b < w for p in prompts),
        "several requests": s["requests"] > 1,
        "draft accepted": s["acceptance_rate"] > 0,
    }
    return tuple(labels + sorted(k for k, v in flags.items() if v))


def target_value(res: RunResult) -> float:
    """Peak KV utilisation (0..1): pressure on the pool approaches admission/reserve bugs."""
    s = res.summary
    return s["peak_kv_blocks"] / max(1, s["num_blocks"])
