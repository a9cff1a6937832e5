"""Host preparation: everything a step needs that depends on the trace alone (numpy, numba)."""
