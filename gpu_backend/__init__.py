"""GPU replay of kvsim traces through real FlashInfer kernels, and its CPU reference twin.

Pipeline: tracedata (read) -> layout (flat kernel inputs, numpy) -> pool (poisoned paged KV) ->
replay (FlashInfer) | reference (CPU, sim.check.access) -> oracle (truth, verdicts). The
simulator never imports this package; this package reads only the trace format (docs/trace.md).
"""
