"""Whole-simulation property: the fixed profiles never violate an invariant on generated
scenarios (tiny pools, block-boundary prompts, shared prefixes, forced acceptance, ...)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from sim.fuzz.campaign import evaluate
from sim.fuzz.labels import path_labels
from sim.fuzz.strategies import scenario_dicts

# Known modeling bugs found by this fuzzer, waiting for the lead's fix (each has its shrunk
# scenario in tests/regressions/pending/). Remove an entry when its bug is fixed; the test then
# guards against it coming back.
KNOWN_PENDING: frozenset[str] = frozenset()  # invariants of known, unfixed bugs (none now)


@pytest.mark.parametrize("profile", ["trtllm-post-17264", "vllm-v1-legacy"])
@given(sc=scenario_dicts())
def test_fixed_profiles_never_violate(profile: str, sc: dict[str, Any]) -> None:
    hits, _ = evaluate(sc, profile)
    new = [h for h in hits if h.invariant not in KNOWN_PENDING]
    assert not new, f"{profile}: {new[0].invariant}: {new[0].message}"


@given(sc=scenario_dicts())
def test_labels_describe_the_run(sc: dict[str, Any]) -> None:
    _, res = evaluate(sc, "trtllm-post-17264")
    if res is not None:
        labels = path_labels(sc, res)
        assert f"spec={sc['spec']['mode']}" in labels
        assert ("reuse hit" in labels) == (res.summary["reused_tokens"] > 0)
