"""Stable prefix hash chain h_i = H(h_{i-1}, tokens of block i) — never Python's hash()."""

from __future__ import annotations

import hashlib

import numpy as np

_M = (1 << 64) - 1


def chain_hashes(tokens: np.ndarray, block: int, num_full: int, parent: int = 0,
                 kind: str = "blake2b") -> list[int]:
    """Hashes of the first `num_full` full blocks of `tokens` (64-bit)."""
    if kind == "polynomial":
        return _polynomial(tokens, block, num_full, parent)
    out = []
    h = parent
    data = np.ascontiguousarray(tokens[: num_full * block], dtype=np.int32)
    for i in range(num_full):
        d = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8)
        d.update(data[i * block:(i + 1) * block].tobytes())
        h = int.from_bytes(d.digest(), "little")
        out.append(h)
    return out


def _polynomial(tokens: np.ndarray, block: int, num_full: int, parent: int) -> list[int]:
    """h_i = h_{i-1} * 31^B + sum_j t_j * 31^j (mod 2^64): the weak rolling hash of the
    `weak_block_hash` fault. Kept only to reproduce that bug; never the default."""
    w = [pow(31, j, 1 << 64) for j in range(block)]
    shift = pow(31, block, 1 << 64)
    out, h = [], parent
    for i in range(num_full):
        blk = tokens[i * block:(i + 1) * block].tolist()
        h = (h * shift + sum(t * wj for t, wj in zip(blk, w, strict=True))) & _M
        out.append(h)
    return out
