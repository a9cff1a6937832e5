"""The poisoned paged KV pool and the deterministic K/V/Q content (same function on CPU and GPU).

Pool layout (NHD, one 5-D tensor as FlashInfer takes it):

    index:  0 .. G-1        G .. G+N-1            G+N .. G+N+G-1
            [ guard, NaN ]  [ page id p at p+G ]  [ guard, NaN ]
    shape:  [N + 2G, 2, B, H_kv, D]   ([:, 0] = K, [:, 1] = V)

Every slot starts as NaN (never written); guards stay NaN, so any read outside live data shows up
as NaN in the row's output, and any write to a guard shows up in the page checksums.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

# Content: x = sin(2*pi * ((t*A + p*P + C) mod M) / M), exact integer phase so CPU and GPU agree
# bit for bit up to one ulp of fp32 sin (then rounded to bf16). Adjacent positions give unrelated
# values, so a K/V/Q built at the wrong RoPE position changes the output by O(0.1), far above
# the kernels' bf16 noise.
_M = 1_000_003
_Q_GAIN = 4.0  # logits std ~2 at D=128: attention weights are far from uniform


@functools.lru_cache(maxsize=32)
def _coeffs(kind: int, heads: int, dim: int, device: str) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(0x6B76 + kind)
    return tuple(torch.as_tensor(rng.integers(1, _M, size=(heads, dim), dtype=np.int64),
                                 device=device) for _ in range(3))


def content(tokens: torch.Tensor, positions: torch.Tensor, kind: int, heads: int, dim: int,
            dtype: torch.dtype, rope_rows: int | None = None) -> torch.Tensor:
    """K (kind 0), V (kind 1) or Q (kind 2) of tokens at positions.

    Args: tokens, positions: int64 [n] on the target device. Returns [n, heads, dim] in dtype.
    rope_rows: rows of the engine's RoPE table (max_position_embeddings), engine side only. K and
    Q are rotated through that table: a position >= rope_rows reads past its end, so that token's
    K/Q is garbage, emulated as NaN (V is not rotated). The truth side passes None.
    """
    a, p, c = _coeffs(kind, heads, dim, str(tokens.device))
    t = tokens.to(torch.int64)[:, None, None] % _M
    q = positions.to(torch.int64)[:, None, None] % _M
    phase = (t * a + q * p + c) % _M
    x = torch.sin(phase.to(torch.float32) * (2 * math.pi / _M))
    if rope_rows is not None and kind != 1:
        x = torch.where((positions.to(torch.int64) >= rope_rows)[:, None, None],
                        float("nan"), x)
    return (x * _Q_GAIN if kind == 2 else x).to(dtype)


def torch_dtype(name: str) -> torch.dtype:
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16}
    if name not in names:
        from sim.errors import TraceError

        raise TraceError(f"model dtype {name!r}: the replay supports {sorted(names)}")
    return names[name]


class KVPool:
    """The pool tensor plus the poison/copy/checksum operations the replay applies between steps."""

    def __init__(self, num_pages: int, guard: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.guard, self.num_pages, self.page_size = guard, num_pages, page_size
        shape = (num_pages + 2 * guard, 2, page_size, kv_heads, head_dim)
        self.data = torch.full(shape, float("nan"), dtype=dtype, device=device)

    @property
    def total(self) -> int:
        return int(self.data.shape[0])

    def index(self, page_id: int) -> int:
        return page_id + self.guard

    def poison_pages(self, idx: torch.Tensor) -> None:
        if idx.numel():
            self.data[idx] = float("nan")

    def poison_slots(self, pages: torch.Tensor, slots: torch.Tensor) -> None:
        self.data[pages, :, slots] = float("nan")  # an empty index is a no-op, no host sync

    def copy_slots(self, dst: int, src: int, n: int) -> None:
        self.data[dst, :, :n] = self.data[src, :, :n]

    def checksum(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """[pages] (or [len(idx)]) int64: one reduction over the raw bits, so NaN patterns
        compare exactly."""
        if idx is not None:
            per = self.data[0].numel() // 2  # int32 words in a page
            return self.data[idx].view(torch.int32).reshape(idx.shape[0], per).sum(
                1, dtype=torch.int64)
        # Raw 32-bit words summed in int64 (no fp32 copy of the pool): a write of different bits
        # changes the sum unless it cancels exactly, which deterministic content never does.
        return self.data.view(self.total, -1).view(torch.int32).sum(dim=1, dtype=torch.int64)
