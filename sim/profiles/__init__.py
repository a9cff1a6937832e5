from sim.profiles.catalog import FAULTS, PROFILES, Fault, resolve_profile
from sim.profiles.switches import Switches, switch_names

__all__ = ["FAULTS", "PROFILES", "Fault", "Switches", "resolve_profile", "switch_names"]
