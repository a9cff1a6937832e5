"""Tools built on the replay: the agreement matrix and fault catalog, calibration, fidelity."""
