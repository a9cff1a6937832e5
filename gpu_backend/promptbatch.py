"""A prompts' step's batch before its pages (`prompts_batch`): what its content and reference
read, so that `prepare` queues those launches before it makes the whole batch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from gpu_backend.layout import I32, Columns, StepBatch
from sim.trace.records import StepRecord


def prompts_batch(step: StepRecord, c: Columns, page_size: int, guard: int,
                  per_token: bool = True) -> StepBatch | None:
    """Step `step` as far as its content and reference read it, before its pages: the rows'
    own fields and the per-token ones are `build_step`'s, the page fields (the engine's table,
    its writes, the truth's pages, the rejected drafts) are empty. `prepare` queues a prompts'
    step's content and reference from it and makes the whole batch after their launches: at
    64 x 2k `build_step` was ~40% of the host's time before the device's first launch.
    Only a step of context rows, each with queries and its appends its queries (as a prompts'
    step's), from columns that passed the lengths check (`TraceData.checked`); else None.
    per_token False: each token's row and true position are None (`token_rows` makes them),
    for a step whose content the device makes from its rows (`truthprep.row_content`)."""
    q_len = c["q_len"]
    if not len(q_len) or not c["is_ctx"].all() or (q_len <= 0).any() or \
            not np.array_equal(c["append_pos_len"], q_len):
        return None
    R = len(q_len)
    qo = np.zeros(R + 1, dtype=I32)
    np.cumsum(q_len, out=qo[1:])
    i32, i64 = np.zeros(0, dtype=I32), np.zeros(0, dtype=np.int64)
    unmade: Any = None  # made by `token_rows`: a reader before it fails at once
    b = StepBatch(
        step=step.step, backend=step.backend, plan_q_len=step.plan_q_len,
        plan_batch=step.plan_batch, plan_cache_size=step.plan_cache_size, page_size=page_size,
        guard=guard, requests=c["request"], is_ctx=c["is_ctx"], q_len=q_len, qo_indptr=qo,
        kv_indptr=i32, kv_indices=i32, last_page_len=i32, kv_len=i32,
        block_table=np.zeros((R, 0), dtype=I32), row_of_token=unmade, tokens=c["tokens"],
        app_row=unmade, app_tokens=c["tokens"], app_rope=c["rope_pos"], rope_pos=c["rope_pos"],
        append_pos=c["append_pos"], true_pos=unmade, committed=c["committed"],
        new_tokens=c["new_tokens"], allowed_pages=i64, engine_write=i64,
        write_ok=np.zeros(0, dtype=bool), reject_page=i64, reject_slot=i64, xqa_indptr=i32,
        xqa_indices=i32, xqa_last_page_len=i32)
    return token_rows(b) if per_token else b


def token_rows(b: StepBatch) -> StepBatch:
    """`prompts_batch(per_token=False)`'s batch with each token's row and true position."""
    from gpu_backend import prepk  # numba: loaded where a replay prepares, as `flatten`

    row, true_pos = prepk.token_rows(b.q_len, b.committed)
    return replace(b, row_of_token=row, app_row=row, true_pos=true_pos)
