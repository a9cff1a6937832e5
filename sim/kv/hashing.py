"""Stable prefix hash chain h_i = H(h_{i-1}, tokens of block i) — never Python's hash()."""

from __future__ import annotations

import hashlib

import numpy as np


def chain_hashes(tokens: np.ndarray, block: int, num_full: int, parent: int = 0) -> list[int]:
    """Hashes of the first `num_full` full blocks of `tokens` (64-bit)."""
    out = []
    h = parent
    data = np.ascontiguousarray(tokens[: num_full * block], dtype=np.int32)
    for i in range(num_full):
        d = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8)
        d.update(data[i * block:(i + 1) * block].tobytes())
        h = int.from_bytes(d.digest(), "little")
        out.append(h)
    return out

