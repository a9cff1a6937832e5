"""Hypothesis profiles, picked by the HYPOTHESIS_PROFILE environment variable (default `dev`).

- `ci`: derandomized (the same examples on every run, so CI is reproducible and a red build is
  not flaky), bounded example counts, no deadline (shared CI cores make timing noisy), and the
  failing example's blob printed so it can be replayed with `@reproduce_failure`.
- `dev`: random, a few more examples than CI; the local database remembers failures.
- `fuzz`: long local runs that hunt rather than check.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=60, deadline=None,
                          print_blob=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=20_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
