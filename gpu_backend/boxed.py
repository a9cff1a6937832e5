"""A CUDA graph step's results in the loop's device arena (`graphs.StepGraphs.run`), as the
read-back finds them (`readback`).

Why: a tensor of its own for each step's results, and views of it, cost the loop ~20 µs of the
H200's host a step; a copy by address into an arena none of that (`graphs.run`
12.4-19.6 against 21.6-29.4 ms over a 256-step 64 x 2k replay)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_backend import rawcopy


@dataclass
class Boxed:
    """Bytes [off, off + 8n + w) of `arena`: token errors [2, n] fp32 (`oracle.token_errors`),
    then the moved flags of the step's w target pages (bool)."""
    arena: torch.Tensor  # uint8, on the device
    off: int
    n: int
    w: int

    @property
    def end(self) -> int:
        return self.off + 8 * self.n + self.w

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token errors [2, n], moved flags [w]) as views of the arena."""
        a, o, n = self.arena, self.off, self.n
        return (a[o: o + 8 * n].view(torch.float32).view(2, n),
                a[o + 8 * n: self.end].view(torch.bool))

    def host(self, buf: np.ndarray, at: int) -> tuple[np.ndarray, np.ndarray]:
        """(token errors [2, n] float32, moved flags [w] bool) from `buf`, the arena's bytes
        from `at` on, copied home."""
        o, n = self.off - at, self.n
        return (buf[o: o + 8 * n].view(np.float32).reshape(2, n),
                buf[o + 8 * n: o + 8 * n + self.w].view(np.bool_))


class Arena:
    """The device bytes the graph steps' results are copied into, step after step, each 8-byte
    aligned. A full or sealed arena is left to the read-backs that hold its steps (`Boxed`):
    the caching allocator reuses it once they are gone, in stream order."""

    def __init__(self, steps: int):
        self.steps = steps  # a new arena's room, in steps of the size that asked for it
        self.mem: torch.Tensor | None = None
        self.used = 0

    def put(self, out: torch.Tensor, nbytes: int, n: int, w: int,
            stream: torch.cuda.Stream) -> Boxed:
        """out's first nbytes (token errors [2, n] fp32, moved flags [w]) copied in."""
        if self.mem is None or self.used + nbytes > self.mem.numel():
            self.mem = torch.empty(self.steps * (nbytes + 8), dtype=torch.uint8,
                                   device=out.device)
            self.used = 0
        off = self.used
        rawcopy.d2d(self.mem.data_ptr() + off, out.data_ptr(), nbytes, stream)
        self.used = off + nbytes + (-nbytes % 8)
        return Boxed(self.mem, off, n, w)

    def seal(self) -> None:
        self.mem = None
