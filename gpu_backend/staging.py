"""One host->device transfer per step, from pinned memory, so the replay never stalls the stream.

A copy from pageable host memory makes CUDA synchronize the stream first: twenty small
`torch.as_tensor(np, device="cuda")` a step would serialize host and device twenty times. Here a
step's index arrays are packed into one slot of a ring of pinned int64 buffers and copied with
`non_blocking=True`; a slot is reused only after the event recorded after its copy has passed.
Host tensors the FlashInfer planners read (indptr, last_page_len) come from the same ring, so
their own `.to(device, non_blocking=True)` is asynchronous too.
"""

from __future__ import annotations

import numpy as np
import torch

_RING = 32  # slots; a step uses at most ~8, and fence() runs once a step
_SLOT = 1 << 17  # int64 words per slot (1 MiB); a bigger step grows its slot


class Staging:
    def __init__(self, device: torch.device | str):
        self.dev = torch.device(device)
        self.cuda = self.dev.type == "cuda"
        # pinned allocations cost ~1 ms each: make the whole ring up front, outside the steps
        self.bufs: list[torch.Tensor | None] = [
            torch.empty(_SLOT, dtype=torch.int64, pin_memory=True) if self.cuda else None
            for _ in range(_RING)]
        self.events: list[torch.cuda.Event | None] = [None] * _RING
        self.i = 0

    def _slot(self, n: int) -> torch.Tensor:
        k = self.i % _RING
        self.i += 1
        ev = self.events[k]
        if ev is not None:
            ev.synchronize()  # only this slot's old copy, long finished in steady state
        buf = self.bufs[k]
        if buf is None or buf.numel() < n:
            buf = self.bufs[k] = torch.empty(max(n, _SLOT), dtype=torch.int64, pin_memory=True)
        return buf

    def upload(self, arrays: dict[str, np.ndarray], host: tuple[str, ...] = ()
               ) -> dict[str, torch.Tensor]:
        """Device int64 views of `arrays`; names in `host` also as pinned host int32 copies
        (key "NAME@host", for the planners). Shapes are kept."""
        flat = [np.ascontiguousarray(a, dtype=np.int64).ravel() for a in arrays.values()]
        n = sum(len(f) for f in flat)
        if not self.cuda:
            dev = torch.from_numpy(np.concatenate(flat) if flat else np.zeros(0, np.int64))
        else:
            buf = self._slot(n)
            np.concatenate(flat, out=buf.numpy()[:n]) if flat else None
            dev = buf[:n].to(self.dev, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.events[(self.i - 1) % _RING] = ev
        out: dict[str, torch.Tensor] = {}
        off = 0
        for (name, a), f in zip(arrays.items(), flat, strict=True):
            out[name] = dev[off: off + len(f)].view(a.shape)
            off += len(f)
        for name in host:
            out[name + "@host"] = self.host_i32(arrays[name])
        return out

    def host_i32(self, a: np.ndarray) -> torch.Tensor:
        """A pinned int32 host copy (for the planners), from the ring."""
        if not self.cuda:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
        buf = self._slot(len(a)).view(torch.int32)[: len(a)]
        buf.numpy()[:] = a
        ev = torch.cuda.Event()
        ev.record()  # fenced again by fence(): the planner's copy is enqueued after this point
        self.events[(self.i - 1) % _RING] = ev
        return buf

    def fence(self) -> None:
        """Record, for every slot, that work up to here (the step's planner copies) is queued."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.events = [ev if e is not None else None for e in self.events]
