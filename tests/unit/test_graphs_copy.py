"""gpu_backend/device/graphs.py's bounds, checked before any copy is queued (the copies themselves
run on the GPU: tests/gpu/test_graphs_copy_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from gpu_backend.device import graphs


@pytest.mark.parametrize("offset", [-1, 37, 40])
def test_a_copy_past_the_source_is_refused(offset: int) -> None:
    src, dst = torch.zeros(10, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="outside a 40 B tensor"):
        graphs.into(dst, src, offset, None)  # type: ignore[arg-type]
