"""``bench plan``: the planner (cluster files, memory and time model, search, calibration)."""
