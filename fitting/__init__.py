"""Fitting: measurements + predictions -> calibration factors with cross-validated error (no torch)."""
