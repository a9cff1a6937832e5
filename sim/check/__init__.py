"""Invariant checking from trace records (docs/design.md §3.7): online per step, or offline."""

from sim.check.access import StepAccess, access_of, step_access
from sim.check.checker import StepChecker
from sim.check.registry import INVARIANTS

__all__ = ["INVARIANTS", "StepAccess", "StepChecker", "access_of", "step_access"]
