"""The kernels' out= buffer sets one element of each (token, head) vector NaN, not the whole
buffer (`reference.unwritten`): a token no launch writes, or a head of it, still judges `nan`,
with the error and verdict it had when every element started NaN."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_backend import verdicts, verdicts_jit
from gpu_backend.device import reference


def written(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """out after a 'kernel' that writes whole head vectors (ref's, rounded) of every token but
    4..6, and of token 9 every head but head 1: what a launch over fewer rows leaves."""
    left = out[9, 1].clone()
    out[:4] = ref[:4].to(out.dtype)
    out[7:] = ref[7:].to(out.dtype)
    out[9, 1] = left  # as the buffer held it
    return out


def with_garbage(q: torch.Tensor) -> torch.Tensor:
    """`unwritten`, its unset elements holding finite values, as reused memory may."""
    out = reference.unwritten(q)
    keep = out[..., 0].clone()
    out.fill_(0.25)
    out[..., 0] = keep
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_token_no_launch_writes_judges_as_with_a_whole_nan_buffer(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    n, hq, d = 12, 4, 16
    q = torch.rand(n, hq, d, generator=g).to(dtype)
    ref = torch.rand(n, hq, d, generator=g) * 2 - 1
    whole = written(torch.full_like(q, float("nan")), ref)
    out = written(with_garbage(q), ref)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out[..., 0][[4, 5, 6]].isnan().all() and not out[4, :, 1:].isnan().any()

    want, got = reference.token_errors(whole, ref), reference.token_errors(out, ref)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got[0, [4, 5, 6, 9]].isnan().all() and not got[0, [0, 3, 7, 8, 10]].isnan().any()

    qo, rows = np.array([0, 4, 8, 12]), np.array([3])  # one step of three 4-token rows
    codes = [verdicts_jit.judge(x[0].numpy(), x[1].numpy(), qo, rows, verdicts.DEFAULT_TOL)
             for x in (want, got)]
    for a, z in zip(*codes, strict=True):
        np.testing.assert_array_equal(a, z)
    assert codes[1][0].tolist() == [verdicts.OK, verdicts.NAN, verdicts.NAN]


def test_a_buffer_of_garbage_would_pass_a_token_no_launch_wrote() -> None:
    """Why the sentinel: without it, an unwritten token's error is whatever memory held."""
    q = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    ref = torch.full((3, 2, 8), 0.25)
    bare = torch.empty_like(q).fill_(0.25)
    assert not reference.token_errors(bare, ref)[0].isnan().any()
    assert reference.token_errors(with_garbage(q), ref)[0].isnan().all()
