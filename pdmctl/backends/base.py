"""What every backend shares: the tracker it logs through.

A backend never talks to MLflow. It logs step-indexed metrics (and per-problem
evaluation scores) through a `Tracker`; the job entry point plugs the ledger in,
tests plug in `InMemoryTracker`.

Metric names every backend uses (the report and `pdmctl status` read these):

    train/reward  train/response_length  train/ppo_kl  train/mask_frac
    train/out_of_region_frac  train/mean_divergence  train/disagreement_count
    train/rollout_probs_diff_mean   the rollout/trainer gap, as VeRL's training/rollout_probs_diff_mean
    eval/<dataset>            avg@16 on a held-out set (toy24, toy25, aime24, aime25)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Protocol


class Tracker(Protocol):
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record `metrics` at training step `step`."""

    def log_per_problem(self, dataset: str, step: int, accuracies: Sequence[float], *,
                        correct: Sequence[Sequence[int]] | None = None,
                        answers: Sequence[Sequence[int]] | None = None) -> None:  # fmt: skip
        """Record the per-problem accuracies of one evaluation (for the two-level bootstrap) and, where the
        backend has them, each sample's correctness and answer id (problems × samples; -1: no answer), for
        pass@k and maj@k."""

    def notice(self, message: str) -> None:
        """Something the user should know about this attempt (a damaged checkpoint skipped, ...)."""


class InMemoryTracker:
    """A tracker that keeps everything in memory: for tests and the direction analysis."""

    def __init__(self) -> None:
        self.metrics: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self.per_problem: dict[str, list[tuple[int, list[float]]]] = defaultdict(list)
        self.samples: dict[str, list[tuple[int, list[list[int]], list[list[int]]]]] = defaultdict(list)
        self.notices: list[str] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.metrics[name].append((step, float(value)))

    def log_per_problem(self, dataset: str, step: int, accuracies: Sequence[float], *,
                        correct: Sequence[Sequence[int]] | None = None,
                        answers: Sequence[Sequence[int]] | None = None) -> None:  # fmt: skip
        self.per_problem[dataset].append((step, [float(a) for a in accuracies]))
        if correct is not None and answers is not None:
            self.samples[dataset].append((step, [list(map(int, r)) for r in correct],
                                          [list(map(int, r)) for r in answers]))  # fmt: skip

    def notice(self, message: str) -> None:
        self.notices.append(message)

    def history(self, name: str) -> list[tuple[int, float]]:
        return list(self.metrics.get(name, []))


class NodeLost(RuntimeError):
    """A node of the job was lost mid-run (its Ray step ended, or Ray declared it dead): the attempt cannot go
    on, though nothing is wrong with the run. The job records it as failed and, under SLURM, asks for its
    next attempt (`pdmctl.job.requeue_after_node_loss`). The message is one line."""
