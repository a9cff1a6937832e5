"""A long step's reference left running on the side stream while the steps after it run.

A 64 x 2k prompts' step's fp32 reference is ~9 ms of tensor-core work on the H200, and its
token errors wait for it. Until round 33 the replay's stream then waited for both (`oracle.join`)
before the first generation step, whose kernels mostly read memory. Now, for a step the loop
reads back alone (`driver.SEND_TOKENS` query tokens or more), the token errors and their
read-back are queued on the side stream behind the reference (`finish`), and the replay's stream
goes on: the generation steps' kernels can take the SMs the reference leaves. The replay's own
work runs on a stream of higher priority than the side stream's (`own_stream`), so the device
starts its blocks first.

What the steps after it may not do while the reference reads the truth: write a truth slot at
a position the reference reads. The reference of a step's rows reads each row's keys below its
committed + queries; a later row of the same request writes at its committed and beyond, which
is never below (`overwrites`). Any other row (a new request, maybe in a slot the step's
requests freed) or a step filling prefixes joins the side stream first (`guard`). The tensors
the side stream reads are held by the step's `Pending` until its verdicts are judged, after
its read-back's event has fired: nothing frees them while they are read.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from gpu_backend.layout import StepBatch
from gpu_backend.oracle import TruthStore, join, token_errors

# the side stream's work of a long step is left unjoined (module docstring); False: the replay's
# stream waits for its reference before the next step, as before round 33
ENABLED = True
# the replay's own stream's priority (lower is higher in CUDA; the side stream's is 0, the
# lowest); 0: the caller's stream, as before round 33
PRIORITY = -1


@dataclass
class Unjoined:
    """Side-stream work the replay's stream has not waited for: each request's keys below
    `limit` are read (requests sorted, limit beside them); `done` fires after it."""
    requests: np.ndarray
    limit: np.ndarray
    done: torch.cuda.Event


def finish(truth: TruthStore, b: StepBatch, out: torch.Tensor, ref: torch.Tensor
           ) -> torch.Tensor:
    """Queue step b's token errors on the side stream after its kernels' output and its
    reference; the replay's stream does not wait for them (`truth.unjoined`)."""
    side = truth.side
    assert side is not None
    side.wait_stream(torch.cuda.current_stream())  # the kernels' output
    with torch.cuda.stream(side):
        tok = token_errors(out, ref)
        done = torch.cuda.Event()
        done.record()
    order = np.argsort(b.requests, kind="stable")
    truth.unjoined = Unjoined(b.requests[order].astype(np.int64),
                              (b.committed + b.q_len)[order].astype(np.int64), done)
    return tok


def guard(truth: TruthStore, b: StepBatch, fill: bool) -> None:
    """Before step b's device work: join the side stream if b may write what its unjoined work
    reads, or once that work is done (forgotten then)."""
    u = truth.unjoined
    if u is None:
        return
    if fill or overwrites(u, b) or u.done.query():
        join(truth.side)
        truth.unjoined = None
    else:
        truth.beside_steps += 1


def overwrites(u: Unjoined, b: StepBatch) -> bool:
    """Whether a row of b may write a truth slot below what `u` reads there: a request `u` does
    not know (its slot may be one of theirs, freed), or one whose committed keys are fewer than
    `u` reads."""
    req = b.requests.astype(np.int64, copy=False)
    if not len(req):
        return False
    at = np.minimum(np.searchsorted(u.requests, req), len(u.requests) - 1)
    if not (u.requests[at] == req).all():
        return True
    return bool((b.committed < u.limit[at]).any())


def settle(truth: TruthStore) -> None:
    """The replay's stream waits for the side stream's unjoined work (the replay's end)."""
    if truth.unjoined is not None:
        join(truth.side)
        truth.unjoined = None


@contextmanager
def own_stream(device: torch.device | str) -> Iterator[None]:
    """The replay's work on a stream of `PRIORITY` (on CUDA), after the caller's work; the
    caller's stream waits for it at the end."""
    dev = torch.device(device)
    if not PRIORITY or dev.type != "cuda":
        yield
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    mine, cur = _streams(index, PRIORITY), torch.cuda.current_stream(index)
    mine.wait_stream(cur)
    try:
        with torch.cuda.stream(mine):
            yield
    finally:
        cur.wait_stream(mine)


@functools.cache
def _streams(index: int, priority: int) -> torch.cuda.Stream:
    """One a device and priority for every replay of the process (the caching allocator keeps
    what a stream freed for that stream)."""
    return torch.cuda.Stream(index, priority=priority)
