"""The fast engine: the reference engine's semantics compiled (numba) for the scenarios where
the hot path is plain decode (no MTP, no overlap, no reuse); the same trace, byte for byte."""

from sim.fast.columns import Chunk, StepStream, request_records
from sim.fast.engine import FastEngine, supports

__all__ = ["Chunk", "FastEngine", "StepStream", "request_records", "supports", "warm"]

_warm = False


def warm() -> None:
    """Compile the kernel now (or load it from numba's cache), outside anything timed: the
    fuzzer's hang guard, benchmarks. Idempotent; a tiny one-request run."""
    global _warm
    if _warm:
        return
    from sim.api import parse_scenario, run
    run(parse_scenario({"spec": {"mode": "none"}, "overlap": {"enabled": False},
                        "cache": {"reuse": "off", "tokens_per_block": 4, "num_blocks": 8},
                        "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 3,
                                                   "output_len": 2}]}}),
        check=False, engine="fast", collect=False)
    _warm = True
