"""Ranges of the command-line options, checked before any work: a flag's value is user input
like a file's. Each check raises `OptionError` (exit 2, one line naming the flag)."""

from __future__ import annotations

import math

from sim.errors import KvsimError

MAX_WORKERS = 256  # local processes; more only thrash a host's cores and memory
MAX_SECONDS = 86_400  # a budget past a day is a typo, not a plan
MAX_SEED = 2**63 - 1


class OptionError(KvsimError):
    """A command-line option's value is out of its range."""


def _range(flag: str, value: float, lo: float, hi: float, what: str) -> None:
    if isinstance(value, float) and not math.isfinite(value) or not lo <= value <= hi:
        raise OptionError(f"{flag}: {what} (got {value})")


def check_workers(value: int | None, flag: str = "--workers") -> None:
    if value is not None:
        _range(flag, value, 0, MAX_WORKERS, f"0 to {MAX_WORKERS} processes")


def check_seed(value: int | None, flag: str = "--seed") -> None:
    if value is not None:
        _range(flag, value, 0, MAX_SEED, "an integer in [0, 2**63 - 1]")


def check_seconds(value: float, flag: str) -> None:
    """A time budget: finite, more than 0 and at most a day."""
    _range(flag, value, 0, MAX_SECONDS, f"seconds in (0, {MAX_SECONDS}]")
    if value == 0:
        raise OptionError(f"{flag}: seconds in (0, {MAX_SECONDS}] (got {value})")


def check_tolerance(value: float | None, flag: str = "--tol") -> None:
    if value is not None:
        _range(flag, value, 0, 1e9, "a finite number >= 0")


def check_count(value: int | None, flag: str) -> None:
    """How many items to print: 0 or more."""
    if value is not None:
        _range(flag, value, 0, 2**63 - 1, "an integer >= 0")
