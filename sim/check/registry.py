"""Invariant ids and one-line descriptions (docs/design.md §3.7), for `kvsim profiles`, reports."""

from __future__ import annotations

from sim.trace.records import Violation

INVARIANTS: dict[str, str] = {
    "I1": "reservation covers reach: committed + q_len <= C and ceil(C/B) blocks are allocated",
    "I2": "exposed pages cover every access: max append pos < nb*B and kernel kv_len <= nb*B",
    "I3": "exposed pages are allocated: nb <= allocated (CSR), no -1/free page in the span",
    "I4": "CSR structure: indptr = running sum, ids in pool, no repeats, last_page_len in [1,B]",
    "I5": "rows show only the request's own blocks; appends target blocks it holds alone",
    "I6": "shared prefix blocks are read-only; reuse match <= prompt_len - 1 tokens",
    "I7": "every kernel access stays inside the row's own indptr range / table row",
    "I8": "generation rows: kernel kv_len == committed + q_len",
    "I9": "append_pos[j] == rope_pos[j] == committed + j",
    "I10": "attention reads only slots holding the request's accepted K/V at that position",
    "I11": "host estimate - truth == q_len - prev_new_tokens; first gen step uses the prompt",
    "I12": "host logical width ceil(kv_len_host/B) <= allocated blocks",
    "I13": "FA2/FA3 rows are exactly as wide as their logical length",
    "I14": "the attention plan matches the step's query width and batch; plan cache bounded",
    "I16": "every read/written position < max_pos",
    "I17": "nothing in flight is freed or reassigned; each request is freed exactly once",
    "I20": "CUDA-graph padded batch >= rows",
    "POOL": "refcount == live holders; no alloc of a held block; used + free == pool; idle at end",
}

# Order in which one launch reports, so the most specific sign of each catalog fault comes first
LAUNCH_ORDER = ("I14", "I20", "I12", "I1", "I13", "I2", "I3", "I4", "I7", "I9", "I8", "I11",
                "I16", "I5", "I6", "I10", "POOL")

# Order across one step: what admission found (its cause precedes the launch), the launch's
# own order, then what processing the step's results found (frees, the host's estimate).
CAUSAL_ORDER = ("HOST", "LIVENESS") + LAUNCH_ORDER + ("I17", "I18")
_RANK = {inv: i for i, inv in enumerate(CAUSAL_ORDER)}


def causal_key(v: Violation) -> tuple[int, int, int]:
    """Sort key of a violation: step first, then CAUSAL_ORDER, in which the first invariant
    that fires is the root cause, then request. `run` and `check` list violations by it."""
    return v.step, _RANK.get(v.invariant, len(_RANK)), v.request
