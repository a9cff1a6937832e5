"""GPU replay of kvsim traces through real FlashInfer kernels, and its CPU reference twin.

Read it top-down, as a step flows:

- `trace`: the trace directory's columns as the replay needs them (docs/trace.md, its only input);
- `host/`: each step prepared on the host from the trace alone: its batch (`batch`), the
  engine's flat kernel inputs (`layout`), the block events as pool operations (`events`), the
  truth store's slots, reference groups and target pages (`truth`), a CUDA-graph step's block
  (`graph_block`), staged a chunk of steps at a time (`staging`, `prepare`);
- `device/`: the poisoned paged KV pool and its content (`pool`), the page watch (`watch`),
  the fp32 reference and truth store (`reference`), the CUDA graphs (`graphs`);
- `verdicts`: the read-back of each step's errors and moved pages, the verdicts made of them;
- `replay/`: the loop (`loop`) and its two backends, FlashInfer on the GPU (`flashinfer`) and
  the access model on the CPU (`cpu`); `run` is the entry point the CLI and the tools share;
- `tools/`: the agreement matrix and fault catalog (`agreement`), cost-model calibration and
  fidelity (`fidelity`): users of the library, not parts of it.

Each compiled twin sits beside its definition as `name_jit.py` (numba) or `name_triton.py`.
The simulator never imports this package; this package reads only the trace format.
"""
