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

from sim.api import load_scenario, run
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
ax.set_xticks([1, 2, 3, 4]), ax.set_xlabel("max draft length D")
ax.set_ylabel("% of used KV held as headroom"), ax.legend(), fig.tight_layout();

# %% [markdown]
# ## Over time: one run's `kv_series` (D = 3, overlap on, QPS 8; the first 20 s shown)
# `result.kv_series` holds, per step, the blocks in use and the headroom among them
# (`blocks_reserved_draft`: reserved − committed − new tokens, in blocks; a prompt prefilled in
# chunks also counts its not-yet-prefilled part, hence the spikes).

# %%
sc, base_dir = load_scenario(BASE)
kv = run(sc, check=False, base_dir=base_dir).kv_series.to_pandas()
win = kv[kv["t_ns"] < 20e9]
fig, ax = plt.subplots(figsize=(6, 3), dpi=80)
ax.plot(win["t_ns"] / 1e9, win["blocks_used"], lw=0.8, label="blocks used")
ax.plot(win["t_ns"] / 1e9, win["blocks_reserved_draft"], lw=0.8, label="of which headroom")
ax.set_xlabel("simulated time (s)"), ax.set_ylabel("KV blocks (32 tokens)")
ax.legend(fontsize=8), fig.tight_layout()
kv[["blocks_used", "blocks_reserved_draft"]].describe().loc[["mean", "50%", "max"]]
