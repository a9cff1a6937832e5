"""Engine behaviour switches. A profile is a named set of them; each known bug is one switch away.

Every field is a behaviour of docs/design.md §3.6; the fixed value is the default of `Switches()`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from sim.errors import ProfileError


@dataclass(frozen=True, slots=True)
class Switches:
    # FlashInfer applies the device-side overlap offsets to append positions and kv lengths.
    overlap_correction: bool = True
    # The first generation step (context still in flight) uses the prompt boundary, not N-1+W.
    first_gen_prompt_boundary: bool = True
    # Width of a generation row's page table: "reserved" exposes max(logical, allocated) pages
    # (PR #17264), "logical-host" exposes ceil(kv_len_host/B), "logical-device" ceil(kv_len/B)
    # computed from corrected device lengths (vLLM builds its metadata from device seq_lens).
    gen_table_width: str = "reserved"
    # Attention interface: "xqa" (block table + seq_lens), "fa2" (CSR, length from pages), "fa3".
    backend: str = "xqa"
    # Plan cache key: "fresh" (re-plan every step), "no-width" (q_len missing from the key),
    # "per-batch" (key grows once per batch size seen; TRT-LLM #18557).
    plan_key: str = "fresh"
    # Runtime draft length clamped so no position passes the legal limit (TRT-LLM #4879).
    draft_clamp: bool = True
    # Guaranteed-no-evict counts the 2(W-1)+extra spec/overlap headroom, clamped at 0: kvsim's
    # safe variant, not TRT-LLM's formula (docs/design.md §3.3); vllm-v1 keeps it.
    gne_headroom: bool = False
    # The first context chunk reserves the draft layers' extra KV tokens (TRT-LLM #16280 class).
    reserve_extra_kv: bool = True
    # A finished/paused request's blocks are freed only after its in-flight steps are processed.
    defer_free_in_flight: bool = True
    # A request is terminated once even when two paths finish it (TRT-LLM #12816).
    single_free: bool = True
    # Partial reuse without copy only takes a block nobody else holds.
    nocopy_exclusive: bool = True
    # A CUDA-graph replay refreshes the captured kv_indices/indptr when the generation page
    # tuple changes (TRT-LLM #18769); without it a graph reuses the pages it was captured with.
    refresh_graph_pages: bool = True
    # Prefix reuse on TensorRT-LLM's radix tree, matched by tokens (partial tail blocks,
    # copy only when in use, rewound blocks to the free queue's front, delaying a context that
    # could reuse another's blocks); off: a flat hash map of full blocks.
    reuse_tree: bool = True
    # vLLM keeps block 0 as a never-allocated null block.
    null_block: bool = False


_CHOICES: dict[str, tuple[str, ...]] = {
    "gen_table_width": ("reserved", "logical-host", "logical-device"),
    "backend": ("xqa", "fa2", "fa3"),
    "plan_key": ("fresh", "no-width", "per-batch"),
}


def switch_names() -> list[str]:
    return [f.name for f in fields(Switches)]


def coerce(name: str, value: Any) -> Any:
    """Validate one switch value (from TOML or `--switch NAME=VALUE`)."""
    if name not in switch_names():
        raise ProfileError(f"unknown switch {name!r}; known: {', '.join(switch_names())}")
    default = getattr(Switches(), name)
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ProfileError(f"switch {name} must be true or false, got {value!r}")
        return value
    if value not in _CHOICES[name]:
        allowed = ", ".join(_CHOICES[name])
        raise ProfileError(f"switch {name} must be one of {allowed}, got {value!r}")
    return value


def with_switches(base: Switches, overrides: dict[str, Any]) -> Switches:
    return replace(base, **{k: coerce(k, v) for k, v in sorted(overrides.items())})


def choices(name: str) -> tuple[str, ...]:
    return _CHOICES.get(name, ("true", "false"))
