"""The closed choices of command-line options: typer lists them in --help and refuses others
(exit 2, one line)."""

from __future__ import annotations

from enum import StrEnum


class Engine(StrEnum):
    auto = "auto"  # the fast engine where it models the scenario, else the reference one
    fast = "fast"
    reference = "reference"


class RealEngine(StrEnum):
    vllm = "vllm"  # vLLM 0.33.0's own v1 scheduler, in .venv-vllm (make vllm-env)


class Backend(StrEnum):
    flashinfer = "flashinfer"  # GPU
    reference = "reference"  # CPU


class Watch(StrEnum):
    incremental = "incremental"
    full = "full"


# What `kvsim fuzz --ignore` can look past: an invariant of sim.check.registry (named here, not
# imported: sim.check takes a while to import and every command's start would pay for it; a
# test holds the two equal), LIVENESS, HOST (the host threw), or a hang or crash of the simulator.
class Ignorable(StrEnum):
    I1 = "I1"
    I2 = "I2"
    I3 = "I3"
    I4 = "I4"
    I5 = "I5"
    I6 = "I6"
    I7 = "I7"
    I8 = "I8"
    I9 = "I9"
    I10 = "I10"
    I11 = "I11"
    I12 = "I12"
    I13 = "I13"
    I14 = "I14"
    I16 = "I16"
    I17 = "I17"
    I20 = "I20"
    POOL = "POOL"
    LIVENESS = "LIVENESS"
    HOST = "HOST"
    hang = "hang"
    crash = "crash"
