"""Experiment backends: `toy` (the CPU RL testbed) and `verl` (the real engine)."""
