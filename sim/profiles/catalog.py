"""Named engine profiles and the fault catalog (docs/design.md §3.6, bugs from public history)."""

from __future__ import annotations

from dataclasses import dataclass

from sim.errors import ProfileError
from sim.profiles.switches import Switches, with_switches

PROFILES: dict[str, Switches] = {
    # TRT-LLM PyExecutor with PR #17264: corrected lengths, prompt boundary, reserved-width
    # generation table consumed by the block-table kernel (trtllm-gen; XQA on Hopper).
    "trtllm-post-17264": Switches(),
    # Before the fix: FlashInfer FA2 CSR metadata built from host estimates, never corrected.
    "trtllm-pre-17264": Switches(overlap_correction=False, first_gen_prompt_boundary=False,
                                 gen_table_width="logical-host", backend="fa2",
                                 plan_key="no-width"),
    # vLLM v1: null block 0, FA2 CSR metadata built from device-side seq_lens. The name runs
    # kvsim's model of vLLM's own scheduler (sim/vllm_engine.py), not kvsim's TensorRT-LLM
    # engine; these switches describe its traces.
    "vllm-v1": Switches(gen_table_width="logical-device", backend="fa2", null_block=True,
                        reuse_tree=False),
    # The vllm-v1 profile before it modelled vLLM's scheduler: kvsim's TensorRT-LLM scheduler
    # and KV manager with vLLM's null block, FA2 metadata, a flat hash map of full blocks and,
    # under guaranteed-no-evict, kvsim's headroom-counting admission (vLLM has no such policy)
    # (the fast engine runs it).
    "vllm-v1-legacy": Switches(gen_table_width="logical-device", backend="fa2",
                               null_block=True, reuse_tree=False, gne_headroom=True),
}


@dataclass(frozen=True, slots=True)
class Fault:
    name: str
    switches: dict[str, object]
    invariant: str  # the invariant that fires first on its scenario
    source: str
    mechanism: str


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("uncorrected_overlap", {"overlap_correction": False, "gen_table_width": "logical-host",
                                  "backend": "fa2"}, "I9",
          "TRT-LLM PR #17264 (FlashInfer pre-fix)",
          "host estimate N-1+W used for append positions and kv lengths"),
    Fault("first_gen_host_estimate", {"first_gen_prompt_boundary": False,
                                      "gen_table_width": "logical-host", "backend": "fa2"}, "I12",
          "TRT-LLM PR #17264 review",
          "first generation step sized from N-1+2W: row wider than the allocation"),
    Fault("logical_width_table", {"gen_table_width": "logical-host"}, "I2",
          "TRT-LLM PR #17264 (_get_page_table_num_blocks)",
          "positive offsets (shrinking draft width) reach past the exposed pages"),
    Fault("reserved_table_fa2", {"backend": "fa2"}, "I13",
          "TRT-LLM PR #17264 (decode_plan guard)",
          "FA2 derives length from pages: reserved pages lengthen attention"),
    Fault("plan_without_width", {"plan_key": "no-width", "backend": "fa2",
                                 "gen_table_width": "logical-device"}, "I14",
          "TRT-LLM PR #17264 (PlanParams.q_len_per_req)",
          "a plan built for another query width is reused"),
    Fault("plan_keyed_by_batch", {"plan_key": "per-batch", "backend": "fa2",
                                  "gen_table_width": "logical-device"}, "I14",
          "TRT-LLM #18557", "the eager plan cache grows once per batch size seen"),
    Fault("draft_past_limit", {"draft_clamp": False}, "I16",
          "TRT-LLM #4879; Gemma4 RoPE table", "drafts not clamped at the position limit"),
    Fault("device_ahead_overrun", {"reserve_extra_kv": False}, "I1",
          "TRT-LLM #16280", "draft-layer KV written past the reservation"),
    Fault("free_in_flight", {"defer_free_in_flight": False}, "I17",
          "mini-sglang #89", "a finished request's pages freed while a batch using them runs"),
    Fault("double_free", {"single_free": False}, "I17",
          "TRT-LLM #12816", "a request terminated twice under overlap + reuse"),
    Fault("append_into_shared", {"nocopy_exclusive": False}, "I5",
          "TRT-LLM partial reuse without copy (findMatchingBlock's unused-leaf test dropped)",
          "a partially reused block still held by another request is appended to"),
    Fault("stale_graph_pages", {"refresh_graph_pages": False, "backend": "fa2",
                                "gen_table_width": "logical-device"}, "I2",
          "TRT-LLM PR #18769", "a CUDA graph replays the kv_indices it was captured with "
          "after the request grew a page"),
)}


def resolve_profile(name: str, overrides: dict[str, object] | None = None) -> Switches:
    """`BASE` or `BASE+FAULT[+FAULT...]`, then explicit switch overrides."""
    base, *faults = name.split("+")
    if base not in PROFILES:
        raise ProfileError(f"unknown profile {base!r}; known: {', '.join(PROFILES)}")
    sw = PROFILES[base]
    for f in faults:
        if f not in FAULTS:
            known = ", ".join(FAULTS)
            raise ProfileError(f"unknown fault {f!r} in profile {name!r}; known: {known}")
        sw = with_switches(sw, dict(FAULTS[f].switches))
    return with_switches(sw, dict(overrides or {}))
