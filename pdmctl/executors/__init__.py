"""Executors: where jobs run. `local` (processes on this machine) and `slurm` (job arrays)."""

from pdmctl.executors.base import (
    ClusterProfile,
    Executor,
    ExecutorError,
    JobRequest,
    JobState,
    load_profile,
    make_executor,
)

__all__ = [
    "ClusterProfile",
    "Executor",
    "ExecutorError",
    "JobRequest",
    "JobState",
    "load_profile",
    "make_executor",
]
