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
# # Prefix reuse on the Mooncake conversation trace
# `scenarios/mooncake.toml` replays the first rows of the Mooncake trace from `../shared/traces`
# (its hash ids become shared token content); where the trace is absent it runs the scenario's
# synthetic stand-in with shared prefixes (`synthetic_workload`). Reuse off vs on: hit rate,
# TTFT and KV.

# %%
from pathlib import Path

import matplotlib.pyplot as plt

from sim.sweep import sweep

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
BASE = ROOT / "scenarios" / "mooncake.toml"
trace = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
print("Mooncake trace present:", trace.exists())
grid = {"workload.trace.limit": [60], "cache.reuse": ["off", "full", "partial-copy"]}
res = sweep(BASE, grid, ROOT / "runs" / "notebooks" / "reuse",
            synthetic_workload=not trace.exists()).to_pandas()
res[["grid.cache.reuse", "prefix_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "kv_blocks_mean",
     "output_tps"]]

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(7, 2.8), dpi=80)
a1.bar(res["grid.cache.reuse"], res["ttft_p99_ms"]), a1.set_ylabel("TTFT p99 (ms)")
a2.bar(res["grid.cache.reuse"], 100 * res["prefix_hit_rate"]), a2.set_ylabel("prefix hit rate (%)")
fig.suptitle("prefix reuse on Mooncake", fontsize=10), fig.tight_layout();
