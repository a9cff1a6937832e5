"""The closed choices of command-line options: typer lists them in --help and refuses others
(exit 2, one line)."""

from __future__ import annotations

from enum import StrEnum


class Engine(StrEnum):
    auto = "auto"  # the fast engine where it models the scenario, else the reference one
    fast = "fast"
    reference = "reference"


class Backend(StrEnum):
    flashinfer = "flashinfer"  # GPU
    reference = "reference"  # CPU


class Watch(StrEnum):
    incremental = "incremental"
    full = "full"
