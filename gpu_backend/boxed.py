"""A CUDA graph step's results in the loop's device arena (`graphs.StepGraphs.run` with
`graphs.ARENA`), as the read-back finds them (`readback`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
