"""Device-to-device copies by address, through the CUDA driver (`cuMemcpyDtoDAsync`).

Why: a graph step (`gpu_backend.graphs`) copies its block in and its results out, and through
torch those cost the loop ~100 µs of host a step on the H200 (the block's
view 17-19 and copy_ 32-33, the results' clone 22-31 and its four views 27-28). Here a copy is
one call into the driver: a step's three took 22-24 µs. The addresses are the tensors' own,
queued on the replay's stream where torch's copy would have been, so the caching allocator's
stream-ordered reuse holds as it does for torch's copies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch


@cache
def _driver() -> Callable[[int, int, int, int], int]:
    f = ctypes.CDLL("libcuda.so.1").cuMemcpyDtoDAsync_v2
    f.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f  # type: ignore[no-any-return]


def d2d(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    """Queue a copy of nbytes from device address src to dst on `stream` (no wait)."""
    if nbytes <= 0:
        return
    rc = _driver()(dst, src, nbytes, stream.cuda_stream)
    if rc:
        raise RuntimeError(f"cuMemcpyDtoDAsync failed: CUDA driver error {rc}")


def into(dst: torch.Tensor, src: torch.Tensor, offset: int, stream: torch.cuda.Stream
         ) -> torch.Tensor:
    """dst's bytes from src's, starting `offset` bytes into src (both on the device, dst
    contiguous); returns dst."""
    nbytes = dst.numel() * dst.element_size()
    if offset < 0 or offset + nbytes > src.numel() * src.element_size():
        raise ValueError(f"copy of {nbytes} B at {offset} outside a {src.nbytes} B tensor")
    d2d(dst.data_ptr(), src.data_ptr() + offset, nbytes, stream)
    return dst
