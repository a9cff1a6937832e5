"""The fast engine: the reference engine's semantics compiled (numba) for the scenarios where
the hot path is plain decode (no MTP, no overlap, no reuse); the same trace, byte for byte."""

from sim.jit_cache import drop_stale

drop_stale(__file__)  # before the kernel modules below load anything from numba's cache

from sim.fast.columns import Chunk, StepStream, request_records  # noqa: E402
from sim.fast.engine import FastEngine, supports  # noqa: E402

__all__ = ["Chunk", "FastEngine", "StepStream", "request_records", "supports", "warm"]

_warm = False


def warm() -> None:
    """Compile the kernel and the compiled checker now (or load them from numba's cache),
    outside anything timed: the fuzzer's hang guard, benchmarks. Idempotent; a tiny checked
    one-request run."""
    global _warm
    if _warm:
        return
    from sim.api import parse_scenario, run
    run(parse_scenario({"spec": {"mode": "none"}, "overlap": {"enabled": False},
                        "cache": {"reuse": "off", "tokens_per_block": 4, "num_blocks": 8},
                        "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 3,
                                                   "output_len": 2}]}}),
        check=True, engine="fast", collect=False)
    _warm = True
