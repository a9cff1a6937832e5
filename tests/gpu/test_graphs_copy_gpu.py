"""gpu_backend/device/graphs.py on the device: bytes land where torch's own copy puts them, in
stream order with torch's work."""

from __future__ import annotations

import pytest

from gpu_backend.device import graphs

pytestmark = pytest.mark.gpu


def test_into_copies_the_bytes_at_the_offset_in_stream_order() -> None:
    import torch

    s = torch.cuda.current_stream()
    src = torch.arange(1000, dtype=torch.int32, device="cuda")
    dst = torch.full((7,), -1, dtype=torch.int32, device="cuda")
    src.mul_(3)  # queued before the copy: the copy must see it
    graphs.into(dst, src, 4 * 11, s)
    src.zero_()  # queued after: must not
    assert dst.tolist() == [3 * i for i in range(11, 18)]
    one = torch.zeros(3, dtype=torch.bool, device="cuda")
    graphs.into(one, torch.tensor([0, 1, 1, 0, 1], dtype=torch.uint8, device="cuda"), 2, s)
    assert one.tolist() == [True, False, True]
    graphs.d2d(dst.data_ptr(), src.data_ptr(), 0, s)  # nothing to copy: nothing queued
    assert dst.tolist() == [3 * i for i in range(11, 18)]
