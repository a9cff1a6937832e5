"""The truth side of the replay: contiguous per-request K/V, the fp32 reference output per row,
and the per-row verdicts (DESIGN §6).

Verdicts, most severe first: fault > corrupt > nan > mismatch > ok. Everything here is batched
torch on the replay's device; per-step verdicts stay on the device until the replay ends.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch

from gpu_backend.layout import StepBatch
from gpu_backend.pool import content
from sim.trace.records import RowRecord

OK, MISMATCH, NAN, CORRUPT, FAULT = 0, 1, 2, 3, 4
VERDICTS = ("ok", "mismatch", "nan", "corrupt", "fault")

# bf16 output rounding alone is 2^-9 relative (|out| <= 1 here: a convex mix of V in [-1, 1]),
# and bf16 P·V accumulation adds ~1e-3 (measured noise: docs/gpu.md). A wrong RoPE position or
# a foreign page moves the output by > 5e-2. 2e-2 leaves ~4x margin both ways.
DEFAULT_TOL = 2e-2


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Softmax attention in fp32 with a per-query key limit (key i visible iff i <= limit).

    Args: q [R, W, Hq, D]; k, v [R, Hkv, L, D] (HND: (r, h) flattens into one matmul batch with
    no copy); limit [R, W] int64. Returns [R, W, Hq, D] fp32.
    """
    R, W, Hq, D = q.shape
    hkv = k.shape[1]
    qg = q.float().view(R, W, hkv, Hq // hkv, D)
    s = torch.einsum("rwhgd,rhld->rhgwl", qg, k.float()) / math.sqrt(D)
    keys = torch.arange(k.shape[2], device=q.device)
    mask = keys[None, None, :] <= limit[:, :, None]  # [R, W, L]
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("rhgwl,rhld->rwhgd", p, v.float()).reshape(R, W, Hq, D)


class TruthStore:
    """Contiguous truth K and V per live request, each [slots, H_kv, L, D] in fp32 (values rounded
    to the trace's dtype first, as the kernels see them). A request keeps its slot from its first
    row to its last row in the trace."""

    def __init__(self, rows: dict[int, list[RowRecord]], prompts: dict[int, tuple[int, ...]],
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str):
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        span = 1
        for step in sorted(rows):
            for r in rows[step]:
                span = max(span, r.committed + r.q_len)
                first.setdefault(r.request, step)
                last[r.request] = step
        starts = Counter(first.values())
        ends = Counter(last.values())
        live = peak = 0
        for step in sorted(rows):
            live += starts[step]
            peak = max(peak, live)
            live -= ends[step]
        self.last, self.prompts, self.dims = last, prompts, (kv_heads, head_dim, dtype)
        shape = (max(peak, 1), kv_heads, span, head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v = torch.zeros(shape, dtype=torch.float32, device=device)
        self.slot: dict[int, int] = {}
        self.free = list(range(max(peak, 1)))[::-1]

    def admit(self, b: StepBatch) -> np.ndarray:
        """Give new requests a slot (filling a reused prefix from the prompt); [R] slot ids."""
        for req, committed in zip(b.requests.tolist(), b.committed.tolist(), strict=True):
            if req in self.slot:
                continue
            self.slot[req] = s = self.free.pop()
            if committed > 0:
                self._fill_prefix(s, req, committed)
        return np.array([self.slot[r] for r in b.requests.tolist()], dtype=np.int64)

    def _fill_prefix(self, slot: int, req: int, n: int) -> None:
        toks = self.prompts.get(req, ())
        if len(toks) < n:
            from sim.errors import TraceError

            raise TraceError(f"request {req} starts at committed {n} but requests.parquet holds "
                             f"{len(toks)} of its tokens")
        dev = self.k.device
        t = torch.tensor(toks[:n], device=dev)
        pos = torch.arange(n, device=dev)
        self.write(torch.full((n,), slot, device=dev), t, pos)

    def write(self, slots: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor) -> None:
        h, d, dt = self.dims
        self.k[slots, :, pos] = content(tokens, pos, 0, h, d, dt).float()
        self.v[slots, :, pos] = content(tokens, pos, 1, h, d, dt).float()

    def release(self, b: StepBatch) -> None:
        for req in b.requests.tolist():
            if self.last.get(req) == b.step and req in self.slot:
                self.free.append(self.slot.pop(req))


def reference_arrays(b: StepBatch, slots: np.ndarray) -> tuple[dict[str, np.ndarray], list]:
    """Host-side index arrays of the reference (uploaded with the step): gen rows in one group,
    each ctx row alone. Returns (arrays, groups), a group = (prefix, L, first slot | -1)."""
    gen = np.flatnonzero(~b.is_ctx)
    groups = ([gen] if gen.size else []) + [np.array([i]) for i in np.flatnonzero(b.is_ctx)]
    arrays: dict[str, np.ndarray] = {}
    meta = []
    for g, rows in enumerate(groups):
        ql = b.q_len[rows]
        j = np.arange(int(ql.max()))
        vr, vj = np.nonzero(j[None, :] < ql[:, None])
        sl = slots[rows]
        contiguous = bool(np.all(np.diff(sl) == 1)) if sl.size > 1 else True
        tok = b.qo_indptr[rows][:, None] + np.minimum(j[None, :], ql[:, None] - 1)
        arrays |= {f"g{g}_tok": tok,
                   f"g{g}_limit": b.committed[rows][:, None] + j[None, :],
                   f"g{g}_vr": vr, f"g{g}_vj": vj, f"g{g}_slots": sl}
        span = int((b.committed[rows] + ql).max())
        meta.append((f"g{g}_", span, int(sl[0]) if contiguous else -1))
    return arrays, meta


def reference(truth: TruthStore, dv: dict[str, torch.Tensor], groups: list,
              q: torch.Tensor) -> torch.Tensor:
    """fp32 reference output [nnz_q, Hq, D] for q [nnz_q, Hq, D] (built at true positions)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for pre, L, s0 in groups:
        tok = dv[pre + "tok"]
        R = tok.shape[0]
        if s0 >= 0:  # the rows' slots are consecutive: views, no gather
            k, v = truth.k[s0: s0 + R, :, :L], truth.v[s0: s0 + R, :, :L]
        else:
            k, v = truth.k[dv[pre + "slots"], :, :L], truth.v[dv[pre + "slots"], :, :L]
        o = attend(q[tok], k, v, dv[pre + "limit"])
        vr, vj = dv[pre + "vr"], dv[pre + "vj"]
        out[tok[vr, vj]] = o[vr, vj]
    return out


def row_verdicts(b: StepBatch, dv: dict[str, torch.Tensor], out: torch.Tensor, ref: torch.Tensor,
                 changed: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row verdict codes and max |out - ref| (NaN-free tokens only), both [R] on the device.

    Args: out [nnz_q, Hq, D] kernel output (any float dtype); ref same shape fp32; changed [pages]
    bool, pages whose checksum moved during the step.
    """
    dev = out.device
    R = b.num_rows
    row = dv["row_of_token"]
    o = out.float()
    tok_nan = torch.isnan(o).flatten(1).any(1) & ~torch.isnan(ref).flatten(1).any(1)
    err = (o - ref).abs().flatten(1).amax(1).nan_to_num(0.0)
    row_err = torch.zeros(R, device=dev).scatter_reduce(0, row, err, "amax")
    row_nan = torch.zeros(R, device=dev, dtype=torch.bool).index_put_((row,), tok_nan,
                                                                       accumulate=True)
    allowed = torch.zeros_like(changed)
    allowed[dv["allowed_pages"]] = True
    bad = changed & ~allowed
    ew = dv["engine_write"]
    arow = dv["app_row"]
    own = dv["write_ok"].bool()
    # a row is to blame for a moved page its own append targeted outside its own blocks, or for
    # a page nobody may write this step; a stray change nobody's table explains blames them all
    hit = (changed[ew.clamp(min=0)] & ~own | bad[ew.clamp(min=0)]) & (ew >= 0)
    row_bad = torch.zeros(R, device=dev, dtype=torch.bool).index_put_((arow,), hit,
                                                                      accumulate=True)
    row_bad = row_bad | (bad.any() & ~row_bad.any())  # a stray write nobody's table explains
    code = torch.where(row_err > tol, MISMATCH, OK)
    code = torch.where(row_nan, NAN, code)
    code = torch.where(row_bad, CORRUPT, code)
    return code, row_err
