"""The fast engine: the reference engine's semantics compiled (numba) for the scenarios where
the hot path is plain decode (no MTP, no overlap, no reuse); the same trace, byte for byte."""

from sim.fast.columns import StepStream, request_records
from sim.fast.engine import Chunk, FastEngine, supports

__all__ = ["Chunk", "FastEngine", "StepStream", "request_records", "supports"]
