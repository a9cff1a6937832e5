# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The KV cost of speculative and overlap headroom
# Every scheduled MTP step reserves 1 + D slots; with overlap a second step is reserved before
# the first is processed. Slots reserved beyond what the step commits are headroom:
# `draft_blocks_mean` (time-weighted, in blocks) and its share of the blocks in use.

# %%
from pathlib import Path

import matplotlib.pyplot as plt

from sim.sweep import sweep

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
BASE = ROOT / "sweeps" / "llama8b_h200_base.toml"
grid = {"workload.synthetic.num_requests": [80], "workload.synthetic.qps": [12.0],
        "spec.max_draft_len": [1, 2, 3, 4], "overlap.enabled": [True, False]}
res = sweep(BASE, grid, ROOT / "runs" / "notebooks" / "headroom").to_pandas()
res[["grid.spec.max_draft_len", "grid.overlap.enabled", "kv_blocks_mean", "draft_blocks_mean",
     "draft_frac_of_used", "acceptance_len", "tpot_p99_ms"]]

# %%
fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
for ov, g in res.groupby("grid.overlap.enabled"):
    ax.plot(g["grid.spec.max_draft_len"], 100 * g["draft_frac_of_used"], marker="o",
            label=f"overlap={ov}")
ax.set_xlabel("max draft length D"), ax.set_ylabel("% of used KV held as headroom")
ax.legend()
