"""Roofline step time: max(bytes / bandwidth, FLOPs / peak) + launch, optionally calibrated.

Per forward on one GPU of a tensor-parallel group of `tp` (T = Σ q_len, L layers, db dtype bytes):

    weights  = (L · linear_params + vocab·hidden/tp) · db           read once per step
    acts     = T · L · (4·hidden + 2·(qh+kvh)·hd + 3·inter) · db    linear inputs + outputs
    kv       = L · 2·kvh·hd·db · (Σ kv_len + T)                     read all K/V, write the new
    flops    = 2·T·L·linear_params + 2·logits·hidden·vocab/tp + 4·L·qh·hd·Σ q·(kv − (q−1)/2)

`logits` counts every token of a generation row (verify needs all W) and one per context row.
With a calibration table, attention is the measured kernel time × L and the linears are the
measured GEMMs (or their roofline when the table has none of that shape). One-model MTP adds D
sequential draft passes of `draft_layers` layers + LM head over the batch (D = widest gen row − 1),
and tp > 1 adds two ring all-reduces of T·hidden·db per layer over NVLink.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sim.cost.calibration import Calibration
from sim.cost.hardware import GpuSpec, ModelSpec

if TYPE_CHECKING:
    from sim.cost import CostConfig


class RooflineCost:
    def __init__(self, cfg: CostConfig, model: ModelSpec, gpu: GpuSpec,
                 calib: Calibration | None = None) -> None:
        self.cfg, self.m, self.calib = cfg, model, calib
        tp, db, L = cfg.tp, model.dtype_bytes, model.num_layers
        qh, kvh, inter = model.shard(tp)
        self.qh, self.kvh, self.inter = qh, kvh, inter
        self.bw = gpu.mem_bw * cfg.bw_efficiency
        self.peak = gpu.flops * cfg.flops_efficiency
        self.lin = model.linear_params(tp)
        self.head = model.vocab // tp * model.hidden
        self.w_bytes = (L * self.lin + self.head) * db
        self.act_per_tok = L * (4 * model.hidden + 2 * (qh + kvh) * model.head_dim + 3 * inter) * db
        self.kv_per_tok = L * 2 * kvh * model.head_dim * db
        self.attn_flops = 4 * L * qh * model.head_dim
        ring = 2 * (tp - 1) / tp
        self.comm_ns_per_tok = 2 * L * ring * model.hidden * db / gpu.link_bw * 1e9
        self.gemms = [((qh + 2 * kvh) * model.head_dim, model.hidden),
                      (model.hidden, qh * model.head_dim),
                      (2 * inter, model.hidden), (model.hidden, inter)]

    def device_ns(self, q_lens: np.ndarray, kv_lens: np.ndarray, is_ctx: np.ndarray) -> int:
        if len(q_lens) == 0:
            return 0
        q, kv, ctx = q_lens.astype(np.int64), kv_lens.astype(np.int64), is_ctx.astype(bool)
        tokens, n_ctx = int(q.sum()), int(ctx.sum())
        q_gen = q[~ctx]
        logits = int(q_gen.sum()) + n_ctx
        pairs = float((q * (kv - (q - 1) / 2)).sum())
        kv_bytes = self.kv_per_tok * (int(kv.sum()) + tokens)
        if self.calib is None:
            b = self.w_bytes + self.act_per_tok * tokens + kv_bytes
            f = 2 * tokens * self.m.num_layers * self.lin + 2 * logits * self.head \
                + self.attn_flops * pairs
            t = max(b / self.bw, f / self.peak) * 1e9
        else:
            t = self._linears_ns(tokens, logits) + self._attention_ns(q, kv, ctx)
        draft = int(q_gen.max()) - 1 if len(q_gen) else 0
        t += draft * self._draft_pass_ns(len(q), int(kv.sum()))
        return round(t + self.comm_ns_per_tok * tokens + self.cfg.launch_ns)

    def host_ns(self, num_rows: int, num_tokens: int) -> int:
        c = self.cfg
        return int(c.host_base_ns + c.host_ns_per_row * num_rows + c.host_ns_per_token * num_tokens)

    def _roof_ns(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.bw, flops / self.peak) * 1e9

    def _draft_pass_ns(self, rows: int, kv_sum: int) -> float:
        """One MTP draft token for every row: `draft_layers` decoder layers + the LM head."""
        k, db, L = self.cfg.draft_layers, self.m.dtype_bytes, self.m.num_layers
        nbytes = (k * self.lin + self.head) * db + self.kv_per_tok * k / L * kv_sum
        return self._roof_ns(nbytes, 2 * rows * (k * self.lin + self.head))

    def _linears_ns(self, tokens: int, logits: int) -> float:
        assert self.calib is not None
        L, db = self.m.num_layers, self.m.dtype_bytes
        layer = [self.calib.gemm_us(tokens, n, k) for n, k in self.gemms]
        if any(t is None for t in layer):
            body = self._roof_ns(L * self.lin * db + self.act_per_tok * tokens,
                                 2 * tokens * L * self.lin)
        else:
            body = L * sum(t for t in layer if t is not None) * 1e3
        head = self.calib.gemm_us(logits, self.m.vocab // self.cfg.tp, self.m.hidden)
        if head is None:
            return body + self._roof_ns(self.head * db, 2 * logits * self.head)
        return body + head * 1e3

    def _attention_ns(self, q: np.ndarray, kv: np.ndarray, ctx: np.ndarray) -> float:
        """Generation rows are one decode/verify launch, context rows one prefill launch."""
        total = 0.0
        for sel, is_prefill in ((~ctx, False), (ctx, True)):
            n = int(sel.sum())
            if n == 0:
                continue
            qs, kvs = q[sel], kv[sel]
            if is_prefill:
                kind, q_len = "prefill", float(qs.mean())
            else:
                q_len = float(qs.max())
                kind = "decode" if q_len == 1 else "verify"
            us = self.calib.attention_us(kind, n, q_len, float(kvs.mean())) if self.calib else None
            if us is None:
                pairs = float((qs * (kvs - (qs - 1) / 2)).sum())
                total += self._roof_ns(self.kv_per_tok * (int(kvs.sum()) + int(qs.sum())),
                                       self.attn_flops * pairs)
            else:
                total += us * 1e3 * self.m.num_layers
        return total
