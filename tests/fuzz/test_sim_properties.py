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
# What the real engine itself does, so a faithful profile must show it: TRT-LLM's
# guaranteed-no-evict admission counts no spec/overlap headroom, and on a tight pool a later
# reservation throws on the host (tests/unit/test_engine_side.py pins one such run).
ENGINE_BEHAVIOUR: frozenset[str] = frozenset({"HOST"})


@pytest.mark.parametrize("profile", ["trtllm-post-17264", "vllm-v1-legacy"])
@given(sc=scenario_dicts())
def test_fixed_profiles_never_violate(profile: str, sc: dict[str, Any]) -> None:
    hits, _ = evaluate(sc, profile)
    engine = ENGINE_BEHAVIOUR if profile.startswith("trtllm") else frozenset()
    new = [h for h in hits if h.invariant not in KNOWN_PENDING | engine]
    assert not new, f"{profile}: {new[0].invariant}: {new[0].message}"


@given(sc=scenario_dicts())
def test_labels_describe_the_run(sc: dict[str, Any]) -> None:
    _, res = evaluate(sc, "trtllm-post-17264")
    if res is not None:
        labels = path_labels(sc, res)
        assert f"spec={sc['spec']['mode']}" in labels
        assert ("reuse hit" in labels) == (res.summary["reused_tokens"] > 0)
