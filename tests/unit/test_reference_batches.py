"""The CPU reference kernels and oracle compute in batches that leave out what a row cannot see:
the same outputs as one batch of every row, padded to the step's widest row and longest table
(the old code, 2.3x slower on the default scenario's replay), up to rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from replay_traces import _two

from gpu_backend.device import reference
from gpu_backend.replay.cpu import ReferenceKernels
from gpu_backend.replay.run import run_replay
from gpu_backend.verdicts import DEFAULT_TOL

BF16_ULP_AT_1 = 2.0 ** -7  # the outputs are bf16, as the kernels write them


def _mixed(tmp: Path) -> Path:
    """Step 1: request 2's 40-token prompt beside the decodes of requests 0 and 1."""
    b = _two(29, 45)
    b.request(2, list(range(100, 140)))
    b.step([b.ctx(2), b.gen(0, 0, 0), b.gen(1, 0, 0)], plan_q_len=1, plan_batch=3)
    return b.write(tmp, "mixed")


def test_batches_give_what_one_padded_batch_gave(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bool, torch.Tensor, torch.Tensor]] = []
    batched = ReferenceKernels._attention

    def both(self: ReferenceKernels, pool: Any, b: Any, reads: Any, kernel_len: np.ndarray,
             q: torch.Tensor) -> torch.Tensor:
        got = batched(self, pool, b, reads, kernel_len, q)
        idx, slot = self._physical(pool, reads, "attention")
        whole = torch.full(q.shape, float("nan"), dtype=q.dtype)
        self._batch(pool, b, np.arange(b.num_rows), reads.row, reads.pos, idx, slot,
                    kernel_len, q, whole)
        seen.append((bool(b.is_ctx.any() and (~b.is_ctx).any()), got, whole))
        return got

    monkeypatch.setattr(ReferenceKernels, "_attention", both)
    assert run_replay(_mixed(tmp_path / "t"), "reference", DEFAULT_TOL).ok
    assert any(mixed for mixed, _, _ in seen)
    for _, got, whole in seen:
        assert torch.equal(got.isnan(), whole.isnan())
        torch.testing.assert_close(got, whole, rtol=0, atol=BF16_ULP_AT_1, equal_nan=True)


@pytest.mark.parametrize("lo", [0, 5])
def test_a_long_rows_queries_in_blocks_over_the_keys_they_see(monkeypatch: pytest.MonkeyPatch,
                                                              lo: int) -> None:
    g = torch.Generator().manual_seed(lo)
    W, Hq, Hkv, D, L = 10, 4, 2, 8, 16
    q = torch.rand(1, W, Hq, D, generator=g).bfloat16()
    k, v = (torch.rand(1, Hkv, L, D, generator=g).bfloat16() for _ in "kv")
    limit = (torch.arange(W) + 4)[None, :]  # causal: query j sees keys 0 .. j + 4
    whole = reference.attend(q, k, v, limit, lo)
    cut: list[int] = []
    real = reference._attend
    monkeypatch.setattr(reference, "_attend", lambda q, k, *a: cut.append(k.shape[2]) or
                        real(q, k, *a))
    monkeypatch.setattr(reference, "QUERY_BLOCK", 3)
    got = reference.attend(q, k, v, limit, lo)
    assert cut == [7, 10, 13, 14]  # each block's last query's keys
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-6)
