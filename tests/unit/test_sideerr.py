"""`sideerr.Gate`: which later steps may write truth that a step's reference, still on the side
stream, reads (they then wait for it). The GPU path itself: tests/gpu/test_sideerr.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from gpu_backend.sideerr import Gate


def _b(requests: list[int] | None, committed: list[int] | None, q_len: list[int]) -> Any:
    return SimpleNamespace(
        requests=None if requests is None else np.array(requests, np.int64),
        committed=None if committed is None else np.array(committed, np.int64),
        qo_indptr=np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32))


# a prompts' step: requests 7, 3, 5 with prompts of 4, 0 (no query) and 6 tokens
PROMPTS = _b([7, 3, 5], [0, 2, 0], [4, 0, 6])


def test_the_gate_reads_each_request_up_to_its_last_query() -> None:
    g = Gate(PROMPTS, None)  # type: ignore[arg-type]
    assert g.req.tolist() == [5, 7] and g.top.tolist() == [5, 3]


def test_steps_past_what_the_reference_reads_go_on() -> None:
    g = Gate(PROMPTS, None)  # type: ignore[arg-type]
    assert not g.hits(_b([7, 5], [4, 6], [2, 2]), False)  # the next tokens of both
    assert not g.hits(_b([5], [9], [3]), False)  # one of them, further on
    assert not g.hits(_b([7, 3], [4, 2], [1, 0]), False)  # 3: no query, no write
    assert not g.hits(_b([], [], []), False)


def test_steps_that_may_write_what_it_reads_wait() -> None:
    g = Gate(PROMPTS, None)  # type: ignore[arg-type]
    assert g.hits(_b([7, 5], [3, 6], [2, 2]), False)  # 7 rewrites its last query's position
    assert g.hits(_b([7, 5], [4, 0], [1, 1]), False)  # 5 from the start
    assert g.hits(_b([7, 9], [4, 0], [1, 3]), False)  # 9: new, maybe in a slot they left
    assert g.hits(_b([3], [2], [2]), False)  # 3 had no query: its slot's reads unknown here
    assert g.hits(_b([7, 5], [4, 6], [2, 2]), True)  # a prefix to fill
    assert g.hits(_b(None, None, [2, 2]), False)  # a worker's step: no requests on the loop
    assert Gate(_b([], [], []), None).hits(_b([1], [0], [1]), False)  # type: ignore[arg-type]
