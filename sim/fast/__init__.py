"""The fast engine: the reference engine's semantics compiled (numba) for the scenarios where
the hot path is plain decode (no MTP, no overlap, no reuse); the same trace, byte for byte."""

from sim.jit_cache import drop_stale

drop_stale(__file__)  # before the kernel modules below load anything from numba's cache

from sim.fast.columns import Chunk, StepStream, request_records  # noqa: E402
from sim.fast.engine import FastEngine, supports  # noqa: E402

__all__ = ["Chunk", "FastEngine", "StepStream", "request_records", "supports", "warm"]

_warm = False


def warm() -> None:
    """Compile the kernel, the compiled checker and the trace's page-list codec now (or load
    them from numba's cache), outside anything timed: the fuzzer's hang guard, benchmarks.
    Idempotent; a tiny checked one-request run, its trace written and read back."""
    global _warm
    if _warm:
        return
    import tempfile
    from pathlib import Path

    from sim.api import parse_scenario, run
    from sim.trace.reader import read_trace
    with tempfile.TemporaryDirectory() as tmp:
        res = run(parse_scenario({
            "spec": {"mode": "none"}, "overlap": {"enabled": False},
            "cache": {"reuse": "off", "tokens_per_block": 4, "num_blocks": 8},
            "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 3, "output_len": 2}]}}),
            out=Path(tmp) / "t", check=True, engine="fast", collect=False)
        read_trace(res.trace_dir)  # type: ignore[arg-type]
    _warm = True
