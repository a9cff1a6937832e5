"""`gpu_backend.sidework`'s host side: which steps may run while a long step's reference still
reads the truth on the side stream (the device side is tests/gpu/test_sidework.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from gpu_backend import sidework
from gpu_backend.sidework import Unjoined, guard, overwrites


@dataclass
class _Batch:  # the two StepBatch fields `overwrites` reads
    requests: np.ndarray
    committed: np.ndarray


@dataclass
class _Done:  # a CUDA event that has fired or not
    fired: bool = False

    def query(self) -> bool:
        return self.fired


@dataclass
class _Truth:  # a TruthStore without a side stream: `join` is then nothing
    unjoined: Unjoined | None
    side: None = None
    beside_steps: int = 0
    log: list[str] = field(default_factory=list)


def _unjoined(done: bool = False) -> Unjoined:
    # requests 7, 3, 5 read keys below 2048, 100 and 2050 (sorted by request)
    return Unjoined(np.array([3, 5, 7]), np.array([100, 2050, 2048]), _Done(done))  # type: ignore[arg-type]


def _b(requests: list[int], committed: list[int]) -> _Batch:
    return _Batch(np.array(requests, dtype=np.int64), np.array(committed, dtype=np.int64))


def test_the_same_requests_past_what_is_read_do_not_overwrite() -> None:
    u = _unjoined()
    assert not overwrites(u, _b([7, 3, 5], [2048, 100, 2050]))  # type: ignore[arg-type]
    assert not overwrites(u, _b([5], [2051]))  # type: ignore[arg-type]
    assert not overwrites(u, _b([], []))  # type: ignore[arg-type]


@pytest.mark.parametrize("requests, committed", [
    ([7, 3, 5], [2048, 99, 2050]),  # request 3 rewrites key 99, which its reference reads
    ([5, 7], [0, 2048]),  # a request starting again from its first key
    ([7, 4], [2048, 0]),  # a request the step did not have: maybe in a slot freed by one
    ([8], [5000]),  # past every request the step had
    ([2], [5000]),  # before every one
])
def test_a_row_that_may_write_what_is_read_overwrites(requests: list[int],
                                                      committed: list[int]) -> None:
    assert overwrites(_unjoined(), _b(requests, committed))  # type: ignore[arg-type]


@pytest.mark.parametrize("fill, b, done, kept", [
    (False, ([7, 3, 5], [2052, 104, 2054]), False, True),  # the generation step after it
    (True, ([7, 3, 5], [2052, 104, 2054]), False, False),  # a prefix filled: maybe its slots
    (False, ([7, 9], [2052, 0]), False, False),  # a new request
    (False, ([7, 3, 5], [2052, 104, 2054]), True, False),  # the side's work is done
])
def test_guard_joins_before_a_step_that_may_overwrite(fill: bool, b: tuple[list[int], list[int]],
                                                      done: bool, kept: bool) -> None:
    truth = _Truth(_unjoined(done))
    guard(truth, _b(*b), fill)  # type: ignore[arg-type]
    assert (truth.unjoined is not None) == kept
    assert truth.beside_steps == int(kept)


def test_guard_without_unjoined_work_does_nothing() -> None:
    truth = _Truth(None)
    guard(truth, _b([1], [0]), True)  # type: ignore[arg-type]
    assert truth.unjoined is None and truth.beside_steps == 0


def test_own_stream_off_the_gpu_is_the_callers() -> None:
    with sidework.own_stream("cpu"):
        pass
