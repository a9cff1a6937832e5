"""A FlashInfer 0.7.2 limit the replay found, pinned: the FA2 paged prefill kernel gets a
request's output wrong once the launch's query/output tensors pass 2^32 elements; the FA3 one
(FlashInfer's "auto" choice on Hopper) does not. Found by `bench/gpu_replay.py --sweep` at batch
128, kv 16k on the H200; the replay launches FA2, as the engines it
models do on the paths it replays.

At 32 query heads x head_dim 128 a token is 4,096 elements, so 2^20 = 1,048,576 query tokens in
one launch are enough: 129 prompts of 8,192 tokens put request 128 at exactly 2^32 elements.
The first test shows it on FlashInfer alone (FA3 and an fp32 torch reference as the truth), the
second that the replay reports exactly the two rows concerned.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from replay_traces import Builder, prompt

from gpu_backend.replay.run import run_replay
from gpu_backend.verdicts import DEFAULT_TOL

pytestmark = pytest.mark.gpu

R, L, HQ, HKV, D, B = 129, 8192, 32, 8, 128, 16  # request 128 starts at 128 * 8192 * 4096 = 2^32


def _last_query_reference(q: torch.Tensor, pool: torch.Tensor, r: int) -> torch.Tensor:
    """fp32 attention of request r's last query token over its L keys (all visible)."""
    pages = torch.arange(r * (L // B), (r + 1) * (L // B), device=pool.device)
    k = pool[pages, 0].reshape(L, HKV, D).float().repeat_interleave(HQ // HKV, 1)
    v = pool[pages, 1].reshape(L, HKV, D).float().repeat_interleave(HQ // HKV, 1)
    s = torch.einsum("hd,lhd->hl", q[r * L + L - 1].float(), k) / math.sqrt(D)
    return torch.einsum("hl,lhd->hd", s.softmax(-1), v)


def _prefill(q: torch.Tensor, pool: torch.Tensor, backend: str) -> torch.Tensor:
    """One causal paged-prefill launch of all R requests (L queries over L keys each), into an
    output filled with NaN first."""
    import flashinfer

    dev, bf = q.device, q.dtype
    out = torch.full_like(q, float("nan"))

    def i32(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype=torch.int32, device=dev)

    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device=dev), "NHD", backend=backend)
    w.plan(i32(torch.arange(R + 1) * L), i32(torch.arange(R + 1) * (L // B)),
           i32(torch.arange(R * L // B)), i32(torch.full((R,), B)), HQ, HKV, D, B,
           causal=True, q_data_type=bf, kv_data_type=bf)
    w.run(q, pool, out=out)
    torch.cuda.synchronize()
    return out


def test_flashinfer_fa2_prefill_gets_requests_past_2_32_elements_wrong_fa3_does_not() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    pool = torch.randn((R * L // B, 2, B, HKV, D), dtype=torch.bfloat16, device="cuda",
                       generator=g)
    q = torch.randn((R * L, HQ, D), dtype=torch.bfloat16, device="cuda", generator=g)
    fa3 = _prefill(q, pool, "fa3")
    for r in (0, 1, 127, 128):  # FA3 is right everywhere (the last query sees every key)
        err = (fa3[r * L + L - 1].float() - _last_query_reference(q, pool, r)).abs().max()
        assert err < 2e-2, (r, float(err))
    assert not torch.isnan(fa3).any()
    fa2 = _prefill(q, pool, "fa2")
    diff = (fa2.float() - fa3.float()).abs().nan_to_num(1.0).view(R, L, -1).amax((1, 2))
    assert (diff[1:128] < 2e-2).all(), diff[1:128].max()  # below 2^32 elements: right
    assert torch.isnan(fa2[128 * L:]).any()  # part of request 128 never written ...
    assert diff[0] > 0.1, float(diff[0])  # ... and request 0 written over


def test_the_replay_flags_the_overwritten_and_the_missing_request(tmp_path: Path) -> None:
    b = Builder(num_blocks=R * (L // B + 1), hq=HQ, hkv=HKV, d=D)
    for i in range(R):
        b.request(i, prompt(i, L))
    b.step([b.ctx(i) for i in range(R)])
    res = run_replay(b.write(tmp_path / "t", "prefill_past_2_32"), "flashinfer", DEFAULT_TOL)
    bad = {(r.step, r.request): r.verdict for r in res.rows if r.verdict != "ok"}
    assert bad == {(0, 0): "mismatch", (0, 128): "nan"}
