"""`--backend reference`: the kernels emulated in torch on the CPU through sim.check.access.

The access model says which (position, page, slot) each row's attention reads and its append
writes, exactly as FlashInfer 0.7.2 would (docs/design.md §3.5); this module only turns those
accesses into pool reads/writes and fp32 softmax attention, so the GPU and CPU replays differ only
in who computes. An ordinal past the table (WILD) reads the -1 entries both backends place after
`kv_indices` (layout.TAIL): the guard page before page 0. A page id past the guard band is
undefined on the device; the reference reports it as a fault instead of guessing.

Plans: the access model has none, but a launch run with a plan built for another shape
(`batch.stale_plan`) gets FlashInfer 0.7.2's host-side check of
BatchDecodeWithPagedKVCacheWrapper.run() (flashinfer/decode.py): the width it infers is the
query rows // the planned batch; the CUDA-core kernel (a plan of width 1) refuses a width > 1,
the tensor-core path any width other than the planned one (ValueError -> `fault`). A stale plan
that passes the check runs the kernel over another shape's schedule, which the reference does not
model: it computes such a launch as freshly planned (no catalog trace has one; docs/gpu.md).
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_backend.device.pool import KernelFault, KVPool
from gpu_backend.device.reference import attend, unwritten
from gpu_backend.host.batch import StepBatch, launch_runs, stale_plan
from gpu_backend.host.staging import StepArrays
from sim.check.access import CLAMPED, WILD, Accesses, step_access
from sim.trace.records import RowRecord


class ReferenceKernels:
    name = "reference"

    def __init__(self, num_q_heads: int, num_blocks: int):
        self.num_q_heads, self.num_blocks = num_q_heads, num_blocks

    def run_step(self, pool: KVPool, b: StepBatch, rows: list[RowRecord],
                 dv: StepArrays, k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor) -> torch.Tensor:
        acc = step_access(b.backend, rows, b.page_size, self.num_blocks)
        idx, slot = self._physical(pool, acc.writes, "append")
        t = torch.as_tensor(idx)
        s = torch.as_tensor(slot)
        pool.data[t, 0, s] = k
        pool.data[t, 1, s] = v
        refuse_stale_plan(b)
        return self._attention(pool, b, acc.reads, acc.kernel_len, q)

    def _physical(self, pool: KVPool, a: Accesses, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Pool index and slot of each access. CLAMPED reads element offset 0 of the cache: pool
        index 0, a guard page. Page -1 (WILD included) or past num_blocks lands in the guard band
        (poison)."""
        clamped = (a.flags & CLAMPED) != 0
        page = np.where((a.flags & WILD) != 0, -1, a.page)
        idx = np.where(clamped, 0, page + pool.guard)
        slot = np.where(clamped, 0, a.slot)
        out = (idx < 0) | (idx >= pool.total)
        if out.any():
            i = int(np.flatnonzero(out)[0])
            raise KernelFault(f"{what} row {int(a.row[i])} position {int(a.pos[i])}: page "
                              f"{int(a.page[i])} outside the pool and its guard band")
        return idx, slot

    def _attention(self, pool: KVPool, b: StepBatch, reads: Accesses, kernel_len: np.ndarray,
                   q: torch.Tensor) -> torch.Tensor:
        """The step's attention output [nnz_q, Hq, D] in q's dtype, reading as NaN where no query
        is (`reference.unwritten`).
        In batches as the fp32 reference's (`truth`): the gen rows together, each context
        row alone. One batch padded to the step's widest row and longest table made every decode
        row compute a prompt chunk's queries: `make run`'s trace took twice as long to replay."""
        idx, slot = self._physical(pool, reads, "attention")
        out = unwritten(q)  # as the GPU's out= buffer
        gen = np.flatnonzero(~b.is_ctx)
        local = np.empty(b.num_rows, dtype=np.int64)
        for rows in ([gen] if gen.size else []) + [np.array([r]) for r in np.flatnonzero(b.is_ctx)]:
            local[rows] = np.arange(len(rows))
            mine = np.isin(reads.row, rows)
            self._batch(pool, b, rows, local[reads.row[mine]], reads.pos[mine],
                        idx[mine], slot[mine], kernel_len[rows], q, out)
        return out

    @staticmethod
    def _batch(pool: KVPool, b: StepBatch, rows: np.ndarray, at_row: np.ndarray,
               at_pos: np.ndarray, idx: np.ndarray, slot: np.ndarray, kernel_len: np.ndarray,
               q: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of `rows` (their reads: batch row, position, pool index, slot) into out."""
        R, L = len(rows), max(int(kernel_len.max(initial=0)), 1)
        _, two, _, H, D = pool.data.shape
        # [K|V, row, head, position, D]: K and V as `attend` takes them (HND), no copy
        kv = torch.zeros((two, R, H, L, D), dtype=pool.data.dtype)
        kv[:, torch.as_tensor(at_row), :, torch.as_tensor(at_pos)] = \
            pool.data[torch.as_tensor(idx), :, torch.as_tensor(slot)]
        q_len = b.q_len[rows]
        W = int(q_len.max())
        if W == 0:
            return
        j = np.arange(W)
        tok = b.qo_indptr[rows][:, None] + np.minimum(j[None, :], q_len[:, None] - 1)
        # causal, bottom-right aligned: query j sees [0, kernel_len - q_len + j]
        limit = kernel_len[:, None] - q_len[:, None] + j[None, :]
        tok_t = torch.as_tensor(tok)
        o = attend(q[tok_t], kv[0], kv[1], torch.as_tensor(limit))
        o = torch.where(torch.as_tensor(limit >= 0)[:, :, None, None], o, 0.0)
        valid = torch.as_tensor(j[None, :] < q_len[:, None])
        out[tok_t[valid]] = o[valid].to(q.dtype)  # the kernels write bf16/fp16


def refuse_stale_plan(b: StepBatch) -> None:
    """FlashInfer 0.7.2's run() check of a decode plan against the query it is given (module
    docstring); raises KernelFault with FlashInfer's wording where it raises ValueError."""
    for s, e, kind in launch_runs(b):
        stale = stale_plan(b, s, e, kind)
        if stale is None:
            continue
        batch, planned = stale
        width = int(b.qo_indptr[e] - b.qo_indptr[s]) // batch
        if planned == 1 and width > 1:
            raise KernelFault(f"ValueError: q implies q_len_per_req={width}, but the "
                              "non-tensor-core decode kernel only supports q_len_per_req=1. "
                              "(emulated FlashInfer 0.7.2 host check)")
        if planned > 1 and width != planned:
            raise KernelFault(f"ValueError: q implies q_len_per_req={width} but plan() used "
                              f"{planned}; re-plan with the matching q_len_per_req. "
                              "(emulated FlashInfer 0.7.2 host check)")
