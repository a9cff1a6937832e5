"""Every shipped scenario vLLM can express, recorded through vLLM 0.33.0's real scheduler,
checks clean (`kvsim record` checks each step as it writes it, as `kvsim check` would).

A shipped scenario is written for kvsim's TensorRT-LLM profiles; vLLM runs it with vLLM's own
engine knobs in place of those (what `as_vllm` changes): profile `vllm-v1`, its synchronous
step (overlap off: vLLM's async scheduling is not driven), its own scheduling policy (no
`scheduler.policy`), whole-block reuse where the scenario reuses (`partial-copy` -> `full`).
What is left that vLLM cannot express is refused, naming the field; EXPECTED pins which
(docs/vllm.md, "Shipped scenarios", is the same table). A fault scenario is a workload that
shows a kvsim fault (`--profile BASE+FAULT`); here it runs as a plain workload. A trace
workload runs its synthetic stand-in, as `kvsim run --synthetic-workload` does.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from sim.config import parse_scenario
from sim.engines.record import record
from sim.engines.vllm import VllmSession, refuse_unsupported, vllm_python
from sim.errors import ScenarioError
from sim.workload import stand_in

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p for p in (ROOT / "scenarios").rglob("*.toml"))
pytestmark = pytest.mark.skipif(not vllm_python().exists(),
                                reason="no .venv-vllm (make vllm-env)")

POOL = "cache.num_blocks"  # vLLM's start-up check: the pool holds no request of max_seq_len
# None: recorded; else the field the adapter refuses, first
EXPECTED: dict[str, str | None] = {
    "azure.toml": None, "chunked_long.toml": None, "default.toml": None,
    "mooncake.toml": None, "overlap_off.toml": None, "overlap_on.toml": None,
    "reuse_chat.toml": None, "vllm.toml": None, "faults/draft_past_limit.toml": None,
    "mtp_rates.toml": "spec.runtime_draft_lens",
    "worked_example.toml": POOL,
    "faults/append_into_shared.toml": POOL, "faults/double_free.toml": POOL,
    "faults/first_gen_host_estimate.toml": POOL, "faults/free_in_flight.toml": POOL,
    "faults/plan_keyed_by_batch.toml": POOL,
    "faults/stale_graph_pages.toml": POOL, "faults/uncorrected_overlap.toml": POOL,
    "faults/device_ahead_overrun.toml": "spec.extra_kv_tokens",
    "faults/logical_width_table.toml": "spec.runtime_draft_lens",
    "faults/plan_without_width.toml": "spec.runtime_draft_lens",
    "faults/reserved_table_fa2.toml": "spec.runtime_draft_lens",
}


def as_vllm(path: Path) -> dict:
    data = tomllib.loads(path.read_text())
    data["profile"] = "vllm-v1"
    data.setdefault("overlap", {})["enabled"] = False
    data.get("scheduler", {}).pop("policy", None)
    cache = data.setdefault("cache", {})
    if cache.get("reuse", "partial-copy") != "off":
        cache["reuse"] = "full"
    return data


def _name(p: Path) -> str:
    return str(p.relative_to(ROOT / "scenarios"))


@pytest.fixture(scope="module")
def session():
    with VllmSession() as s:
        yield s


@pytest.mark.parametrize("path", SCENARIOS, ids=_name)
def test_shipped_scenario_records_clean_or_is_refused(path, session, tmp_path):
    sc = parse_scenario(as_vllm(path), str(path))
    if sc.workload.trace is not None:
        sc = sc.model_copy(update={"workload": stand_in(sc.workload)})
    want = EXPECTED[_name(path)]
    try:
        refuse_unsupported(sc, _name(path))
        res = record(sc, tmp_path / "trace", path.parent, _name(path), session)
    except ScenarioError as e:
        assert want is not None and f": {want}: " in str(e), str(e)
        return
    assert want is None, f"recorded, but expected refused on {want}"
    assert [(v.invariant, v.step, v.message) for v in res.violations] == []
    assert res.summary["finished"] + res.summary["rejected"] == res.summary["requests"]
