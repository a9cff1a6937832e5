"""Step-level launch invariants I14 (attention plan matches the step) and I20 (graph width)."""

from __future__ import annotations

from collections.abc import Sequence

from sim.check.view import violation
from sim.trace.records import RowRecord, StepRecord, Violation


def check_plans(s: StepRecord, rows: Sequence[RowRecord], limit: int) -> list[Violation]:
    """`limit`: plans a correctly keyed cache can hold (one per query width, plus prefill)."""
    out = []
    if s.plan_q_len != -1:
        # the decode plan serves the generation rows (prefill rows have their own)
        other = next((r for r in rows if r.phase == "gen" and r.q_len != s.plan_q_len), None)
        if other is not None:
            out.append(violation("I14", s.step, other.request, (
                f"plan built for q_len {s.plan_q_len} used for a row of q_len {other.q_len}")))
        if s.plan_batch != len(rows):
            out.append(violation("I14", s.step, -1, (
                f"plan built for batch {s.plan_batch} used for {len(rows)} rows")))
    if s.plan_cache_size > limit:
        out.append(violation("I14", s.step, -1, (
            f"plan cache holds {s.plan_cache_size} plans (bound {limit}: one per query width "
            "and one for prefill)")))
    if 0 < s.graph_width < len(rows):
        out.append(violation("I20", s.step, -1, (
            f"CUDA graph width {s.graph_width} < {len(rows)} rows")))
    return out
