"""A compiled (numba) twin of sim.check.StepChecker over trace columns.

StepChecker stays the oracle; this gives the same (invariant, step, request) of every
violation on the same run, without Python per step, so big runs can be checked in seconds.
When it finds anything, re-run StepChecker for the worded messages.
"""

from __future__ import annotations

import numpy as np

from sim.jit_cache import drop_stale

drop_stale(__file__)  # before the kernel modules below load anything from numba's cache

from sim.check.compiled.driver import CompiledChecker  # noqa: E402
from sim.check.compiled.trace import check_trace_compiled  # noqa: E402

__all__ = ["CompiledChecker", "check_trace_compiled", "warm"]

_warm = False


def warm() -> None:
    """Compile the kernels now (or load them from numba's cache) on a tiny two-step run, in
    both input dtypes a caller gives (trace: int32 lists; fast-engine chunk: the same after
    conversion). Idempotent."""
    global _warm
    if _warm:
        return
    ck = CompiledChecker({"tokens_per_block": 2, "num_blocks": 4})
    z = np.zeros(2, np.int64)
    steps = {"step": np.arange(2), "backend": np.array(["fa2", "xqa"], dtype=object),
             "plan_q_len": z - 1, "plan_batch": z + 1, "plan_cache_size": z,
             "blocks_used": z + 1, "blocks_free": z + 3, "graph_width": z}
    lists = (np.array([0, 1, 2], np.int32), np.zeros(2, np.int32))
    rows = {"step": np.arange(2), "row": z, "request": z, "phase": np.array(["ctx", "gen"],
                                                                            dtype=object),
            "q_len": z + 1, "first_gen": z, "prev_in_flight": z, "kv_indptr": z,
            "last_page_len": z + 1, "kv_len": np.arange(1, 3), "cached_host": np.arange(2),
            "kv_len_host": np.arange(1, 3), "committed": np.arange(2), "reserved": z + 2,
            "shared_blocks": z, "accepted": z - 1, "prev_new_tokens": z - 1,
            "max_pos": z + 8, "pages": lists, "alloc": lists, "tokens": lists,
            "append_pos": (lists[0], np.arange(2)), "rope_pos": (lists[0], np.arange(2))}
    blocks = {"step": np.array([0, 1]), "phase": np.array(["sched", "proc"], dtype=object),
              "seq": np.arange(2), "event": np.array(["alloc", "free"], dtype=object),
              "block": z, "request": z, "refcount": np.array([1, 0]), "src": z - 1,
              "num_tokens": z}
    ck.feed(steps, rows, blocks)
    ck.finish()
    _warm = True
