"""The shared-memory slots a preparation worker ships its chunks through (`gpu_backend.workers`).

Each worker has a ring of SLOTS slots, an anonymous shared mapping made before the fork. The
worker writes a chunk's words and metadata into its next free slot and sends the loop the
slot's number. On a GPU the loop uploads the words from the slot itself, which CUDA has
page-locked (`Pinned`), and the slot is the chunk's until every step of it is judged
(`Ring.release`); elsewhere, and until the registration is done, the loop copies the words and
gives the slot back at once.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from collections import deque
from typing import Any

import numpy as np
import torch

from gpu_backend.staging import Chunk

SLOTS = 3  # shared buffers a worker cycles through. On a GPU the loop uploads a chunk straight
# from its slot (registered with CUDA: no copy into pinned memory, which cost the loop 70-95 µs a
# step at 64 x 2k on the H200's host) and gives the slot back once the chunk's steps
# are all judged (`Ring.release`), so a worker ahead of the loop waits for a slot
SLOT_BYTES = 8 << 20  # a chunk's words and metadata: 8 steps at 64 x 8k are ~2.7 MB, at 128 x 8k
# ~5.3 MB; a larger part goes through the pipe


class Ring:
    """A worker's shared-memory slots (an anonymous shared mapping made before the fork) and
    the count of free ones: the worker takes one to write a chunk into, the loop gives it back
    once nothing reads the chunk any more."""

    def __init__(self, ctx: Any):
        self.mem = mmap.mmap(-1, SLOTS * SLOT_BYTES)  # MAP_SHARED: the fork shares it
        self.free = ctx.Semaphore(SLOTS)
        self.next = 0  # the slot the worker fills next (the loop reads them in the same order)
        # the loop's side: the slots' registration with CUDA, and the chunks read in place
        # from them, oldest first: (the chunk, weakly: its slot is free once it is gone; the
        # event after its upload; its slot's words)
        self.pin: Pinned | None = None
        self.held: deque[tuple[weakref.ref[Chunk], torch.cuda.Event, np.ndarray]] = deque()

    def in_place(self) -> bool:
        """Whether the loop reads the next chunk from its slot: once CUDA has registered the
        slots (before that, and on a CPU, a chunk is copied and its slot is free at once)."""
        return self.pin is not None and self.pin.ok

    def hold(self, chunk: Chunk, words: np.ndarray, done: torch.cuda.Event) -> None:
        """`chunk` was uploaded from its slot (`words`; `done` fires after the upload): the slot
        is the chunk's until it goes."""
        self.held.append((weakref.ref(chunk), done, words))

    def release(self) -> None:
        """Give the worker back the slots, oldest first, whose chunks are gone: their steps
        have all been judged, so their uploads are done and nothing reads their words."""
        while self.held and self.held[0][0]() is None:
            self.held.popleft()
            self.free.release()

    def make_room(self) -> None:
        """Before the loop waits for this worker: if the worker may be waiting for a slot (the
        loop holds them all), the oldest chunk's words move into host memory once its upload is
        done (only `name@host` views read them then), and its slot is free. The loop gives
        slots back only as it judges steps, so it must never wait on a worker that waits on it
        (one worker, or the first chunks)."""
        self.release()
        if len(self.held) < SLOTS:
            return
        ref, done, words = self.held.popleft()
        chunk = ref()
        if chunk is not None:
            done.synchronize()
            chunk.bufs["h64"] = torch.from_numpy(words.copy())
        self.free.release()


class Pinned:
    """The loop's registration of a ring's slots with CUDA (page-locked: a chunk uploads from
    its slot asynchronously). Made in a thread beside the loop (35-50 ms for 4 workers' 96 MB
    on the H200's host: the loop copies the chunks that arrive before it is done),
    after the fork (a registered range is not inherited), and undone by the driver once the
    replay's device work is done (`undo`, in `HostState.cleanup`)."""

    def __init__(self, mem: mmap.mmap):
        self.mem, self.ok = mem, False
        self.thread = threading.Thread(target=self._register, daemon=True)
        self.thread.start()

    def _register(self) -> None:
        rc = torch.cuda.cudart().cudaHostRegister(address(self.mem), len(self.mem), _PORTABLE)
        self.ok = int(rc) == 0

    def undo(self) -> None:
        self.thread.join()
        if self.ok:
            self.ok = False
            with contextlib.suppress(Exception):  # a failed replay's device may be gone
                torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(address(self.mem))


_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, whatever the device


def address(mem: mmap.mmap) -> int:
    return int(np.frombuffer(mem, np.uint8).ctypes.data)
