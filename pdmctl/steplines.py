"""A run's log, readable: one line per training step with the metrics the backend logged at it, written by
the job as the run goes (`pdmctl logs RUN`, `--follow`), and its final metrics the same way.

    pdmctl job: step 3: eval/toy24=0.6133 eval/toy25=0.5898 train/reward=0.5625 train/entropy=1.204 ...

A backend may log a step's metrics in several calls (its training metrics, then an evaluation): the line
waits for the step to end (the next step's first metrics, or the run's end), so that a step is one line.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

PREFIX = "pdmctl job: "


def value_text(value: Any) -> str:
    """A metric's value in four significant digits (an integer as it is; nan and inf as Python writes them)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) < 1e15):
        return str(int(value))
    return f"{value:.4g}"


def metrics_text(metrics: Mapping[str, Any]) -> str:
    """`name=value` for each metric: the held-out evaluations first, then the reward, then the rest as logged."""
    first = sorted(
        metrics, key=lambda name: 0 if name.startswith("eval/") else 1 if name == "train/reward" else 2
    )
    return " ".join(f"{name}={value_text(metrics[name])}" for name in first)


class StepLines:
    """The job's tracker with a line per step printed to the job's output (everything else passes through).
    A context manager: leaving it prints the last step's line, before whatever ended the run is said."""

    def __init__(self, inner: Any, out=None) -> None:
        self.inner = inner
        self.out = out
        self._step: int | None = None
        self._metrics: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:  # log_per_problem, notice, report_evaluation: the inner's
        return getattr(self.inner, name)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if step != self._step:
            self.flush()
            self._step = step
        self._metrics.update(metrics)
        self.inner.log_metrics(metrics, step)

    def flush(self) -> None:
        """Print the step's line (nothing where no metric waits)."""
        if self._step is not None and self._metrics:
            print(f"{PREFIX}step {self._step}: {metrics_text(self._metrics)}", file=self.out or sys.stdout,
                  flush=True)  # fmt: skip
        self._step, self._metrics = None, {}

    def __enter__(self) -> StepLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()
