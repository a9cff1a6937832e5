"""A step's token errors made on the reference's own stream, so the steps after it need not wait
for its reference (`oracle.SIDE_ERRORS`).

Why: at batch 64 x kv 2k the prompts' step's reference (~9.2 ms on the H200) runs beside
FlashInfer's prefill on a stream of its own (`oracle.beside`), but its launch fills every SM, so
the replay's stream got the device only as the reference drained. Then its token errors, on the
replay's stream, waited for the reference (`oracle.join`), and the generation steps behind them:
a 12-step replay's 11 generation steps (~3.4 ms, a few SMs each) ran after all of it (round 38,
`bench/results/round38/`, a profile). Here the errors are made on the reference's stream once
the kernels' output is there, the replay's stream runs at a higher priority (`loop_stream`), and
the generation steps run while the reference still holds the SMs they leave.

What then must still wait: the step's read-back (`readback.send` copies on the side stream,
`Pending.side`), and any later step that writes truth the reference reads (`Gate`): a request
not in the step (its slot may be one the step's requests left), a new request's prefix, or a
position at or below one of the step's queries. The memory of the tensors the side stream reads
is kept from the replay's stream until it is done (`record_stream`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from gpu_backend.layout import StepBatch
from gpu_backend.oracle import token_errors


def late_errors(side: torch.cuda.Stream, out: torch.Tensor, ref: torch.Tensor,
                reads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Token errors of `out` against `ref`, queued on `side` after the current stream's work so
    far (the kernels that wrote `out`), and the event that fires once they and everything before
    them on `side` (the reference) are done. `reads`: the other tensors the side stream's work
    reads (the queries, the content): none of their memory goes back to the current stream
    before then."""
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tok = token_errors(out, ref)
    for t in (out, ref, *reads):
        if t is not None:
            t.record_stream(side)
    done = torch.cuda.Event()
    done.record(side)
    return tok, done


class Gate:
    """The truth that a step whose reference is still on the side stream reads: per request of
    its rows with queries, the highest true position of a query (committed + q_len - 1; the
    reference reads its truth slot at or below it). `done`: fires once the side is done."""

    def __init__(self, b: StepBatch, done: torch.cuda.Event):
        self.done = done
        rows = np.flatnonzero(np.diff(b.qo_indptr) > 0)
        req = np.asarray(b.requests)[rows]
        order = np.argsort(req, kind="stable")
        self.req = req[order]
        self.top = (np.asarray(b.committed)[rows] + np.diff(b.qo_indptr)[rows] - 1)[order]

    def hits(self, b: StepBatch, fill: bool) -> bool:
        """Whether step b may write truth this step's reference reads: b writes its queries'
        true positions (committed + j) in its requests' slots, and new requests' prefixes."""
        if fill or b.requests is None or b.committed is None:
            return True
        rows = np.flatnonzero(np.diff(b.qo_indptr) > 0)
        if not len(rows):
            return False
        req = np.asarray(b.requests)[rows]
        i = np.minimum(np.searchsorted(self.req, req), max(len(self.req) - 1, 0))
        if not len(self.req) or not np.array_equal(self.req[i], req):
            return True  # a request the step did not have: its slot may be one of theirs
        return bool((np.asarray(b.committed)[rows] <= self.top[i]).any())


@functools.cache
def loop_stream(index: int) -> torch.cuda.Stream:
    """The replay's stream on device `index`, above the reference's in priority (CUDA's default
    priority is its lowest, the side stream's): its kernels get the SMs the reference frees
    first. One a process: the caching allocator's blocks are a stream's own."""
    return torch.cuda.Stream(index, priority=-1)  # lower is higher; the default is 0
