"""What the workload hands the simulator: one frozen `RequestSpec` per request, and its error."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.errors import KvsimError


class WorkloadError(KvsimError, ValueError):
    """A workload source is unusable: a missing trace file, a bad row, an impossible config.

    The message names the file (if any), the line and the field, so a user can fix it. It is a
    `KvsimError` (the CLI reports it as bad input) and a `ValueError` (it is one).
    """


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request as it arrives.

    `prompt` is a read-only int32 array (often a view into a shared buffer: copy before writing).
    Requests of one workload come in arrival order: `rid` counts 0.. in that order and
    `arrival_ns` never decreases.
    """

    rid: int
    arrival_ns: int
    prompt: np.ndarray  # int32 token ids, len >= 1
    output_len: int  # max new tokens, >= 1
    session: int = -1  # multi-turn session id, or -1


def read_only(tokens: np.ndarray) -> np.ndarray:
    """`tokens` as a read-only int32 array (a view when it already is int32)."""
    out = np.asarray(tokens, dtype=np.int32)
    if out.flags.writeable:
        out = out.view()
        out.flags.writeable = False
    return out
