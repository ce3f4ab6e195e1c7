"""pdmctl: orchestrate trust-region-mask RL experiments (sweeps, SLURM, MLflow, reports)."""

__version__ = "0.1.0"
