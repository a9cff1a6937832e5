"""Parameter sweeps over scenarios: grid × optional max-QPS-under-SLO search, cached by content.

`run_sweep` runs them on a local process pool (default) or a Ray cluster, writes one row per
grid point to DIR/results.parquet and a plot DIR/sweep.png.
"""

from sim.sweep.runner import SweepOutcome, run_sweep, sweep
from sim.sweep.spec import SweepSpec, load_sweep

__all__ = ["SweepOutcome", "SweepSpec", "load_sweep", "run_sweep", "sweep"]
