"""The pool's page checksums as a Triton kernel (GPU only; `pool.KVPool` elsewhere).

Why: between steps the replay re-sums the pages the last step's rewind and this step's block
events touched: index_select + sum + index_copy_ in torch, 30 µs of host on the H200's host,
13 µs as one launch here (.whl/probe6.py, round 3). Same bits: page sums of the raw 64-bit
words modulo 2^64 (integer addition wraps, so any order gives torch's sum).

Measured and not kept (same probe): a Triton NaN fill for the poison (11.5 µs of host per call
against index_fill_'s 7.3; index_fill_ never synchronizes, its "150 µs" in the round-2 profile
was the profiler's one-time CUPTI buffer request, ~2 ms, counted inside the first call), and the
full checksum with the change flags in one launch (24.9 µs against sum + ne's 19.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_backend.tlaunch import Launcher


@triton.jit
def _page_sums_kernel(WORDS, IDX, OUT, W: tl.constexpr, BLOCK: tl.constexpr):
    page = tl.load(IDX + tl.program_id(0))
    base = WORDS + page * W
    acc = tl.zeros([BLOCK], tl.int64)
    for w0 in range(0, W, BLOCK):
        j = w0 + tl.arange(0, BLOCK)
        acc += tl.load(base + j, mask=j < W, other=0)
    tl.store(OUT + page, tl.sum(acc, 0))


_sums = Launcher(_page_sums_kernel, num_warps=8)


def resum(words: torch.Tensor, sums: torch.Tensor, idx: torch.Tensor) -> None:
    """sums[idx] = the sums of pages idx (words: the pool as int64 [pages, W])."""
    W = int(words.shape[1])
    if idx.numel():
        _sums((int(idx.numel()),), words, idx, sums, W=W, BLOCK=min(triton.next_power_of_2(W),
                                                                    2048))
