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
# # The fault catalog
# Each fault in `sim.profiles.FAULTS` is one set of switches away from the fixed profile
# `trtllm-post-17264`, with a minimal scenario `scenarios/faults/NAME.toml`. Run each scenario
# with the fault on (`trtllm-post-17264+NAME`) and off, and show the first invariant that fires
# (the checker orders violations so the first is the root cause). Off must be clean.

# %%
from pathlib import Path

import pandas as pd

from sim.api import load_scenario, run
from sim.profiles import FAULTS

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
FIXED = "trtllm-post-17264"
loaded = {name: load_scenario(ROOT / "scenarios" / "faults" / f"{name}.toml") for name in FAULTS}
on = {name: run(sc, profile=f"{FIXED}+{name}", base_dir=base)
      for name, (sc, base) in loaded.items()}
off = {name: run(sc, profile=FIXED, base_dir=base) for name, (sc, base) in loaded.items()}

# %%
table = pd.DataFrame([
    {"fault": name, "expected": f.invariant,
     "first (fault on)": on[name].violations[0].invariant if on[name].violations else "-",
     "step": on[name].violations[0].step if on[name].violations else None,
     "violations (on)": len(on[name].violations),
     "violations (fixed)": len(off[name].violations),
     "source": f.source}
    for name, f in FAULTS.items()]).set_index("fault")
table

# %% [markdown]
# The first violation's message, fault on:

# %%
pd.set_option("display.max_colwidth", 120)
pd.DataFrame({"message": {name: r.violations[0].message if r.violations else "-"
                          for name, r in on.items()}})
