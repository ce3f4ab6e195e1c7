"""The declared rule that ends a collapsed run: `stop.collapse` in the run config (docs/SWEEPS.md).

A comparison sweep never ends a run on how it does against the others; it may end one by a rule declared
before the sweep, the same for every run:

    stop.collapse.reward_below: 0.01   the mean train/reward since the previous evaluation is below this,
    stop.collapse.eval_below: 0.02     and every eval/<set> (avg@16, a fraction) is below this,
    stop.collapse.evaluations: 3       at this many evaluations in a row.

All three null (the default): no rule, and the run key is the same as a config without the field. The job
(pdmctl.job) wraps the tracker it hands the backend with `RuleTracker`: after each evaluation is logged (or
reported, for an engine that logs by itself) the rule is checked, and `Collapsed` ends the run. The job
records it KILLED with a reason that starts with `REASON_PREFIX`; `pdmctl status` shows it as stopped,
final like a finished run, and the report counts it at its last evaluation. An evaluation with no training
reward since the one before (the base model's, at step 0) is no evidence either way; the count is kept
within an attempt (a resumed run counts afresh).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FIELDS = ("reward_below", "eval_below", "evaluations")
REASON_PREFIX = "stopped by the collapse rule"


class RuleError(ValueError):
    """A rule that cannot be held to; the message is one line naming the field."""


class Collapsed(Exception):
    """Raised from the job's tracker after an evaluation: the run met its declared collapse rule."""


@dataclass(frozen=True)
class CollapseRule:
    reward_below: float
    eval_below: float
    evaluations: int

    def describe(self) -> str:
        return (f"mean train reward < {self.reward_below:g} and every avg@16 < {100 * self.eval_below:g}% "
                f"at {self.evaluations} evaluations in a row")  # fmt: skip


def declared(config: Mapping[str, Any]) -> bool:
    """Whether the config sets any of the rule's values (else `stop` is left out of the run key)."""

    def any_set(node: Any) -> bool:
        return any(any_set(v) for v in node.values()) if isinstance(node, Mapping) else node is not None

    return any_set(config.get("stop"))


def collapse_rule(config: Mapping[str, Any]) -> CollapseRule | None:
    """The run config's collapse rule, None where none is declared; RuleError for a bad one."""
    stop = config.get("stop")
    if stop is None:
        return None
    if not isinstance(stop, Mapping):
        raise RuleError(f"stop: must be a mapping (stop.collapse.<field>), got {stop!r:.60}")
    if unknown := sorted(set(stop) - {"collapse"}):
        raise RuleError(f"stop: unknown key(s) {', '.join(map(str, unknown))}; the rule is stop.collapse")
    node = stop.get("collapse")
    if node is None:
        return None
    if not isinstance(node, Mapping):
        raise RuleError(f"stop.collapse: must be a mapping of {', '.join(FIELDS)}, got {node!r:.60}")
    if unknown := sorted(set(node) - set(FIELDS)):
        raise RuleError(f"stop.collapse: unknown key(s) {', '.join(map(str, unknown))}; "
                        f"its keys are {', '.join(FIELDS)}")  # fmt: skip
    given = {k: v for k, v in node.items() if v is not None}
    if not given:
        return None
    if missing := [f for f in FIELDS if f not in given]:
        raise RuleError(f"stop.collapse: {', '.join(missing)} not set; the rule needs all of {', '.join(FIELDS)}")
    for name in ("reward_below", "eval_below"):
        value = given[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise RuleError(f"stop.collapse.{name}: must be a finite number >= 0, got {value!r}")
    if given["eval_below"] > 1:
        raise RuleError(f"stop.collapse.eval_below: avg@16 is a fraction, must be <= 1, got {given['eval_below']!r}")
    count = given["evaluations"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise RuleError(f"stop.collapse.evaluations: must be an integer >= 1, got {count!r}")
    return CollapseRule(float(given["reward_below"]), float(given["eval_below"]), count)


class RuleTracker:
    """The job's tracker, checking the collapse rule after each evaluation (everything else passes through)."""

    def __init__(self, inner: Any, rule: CollapseRule) -> None:
        self.inner = inner
        self.rule = rule
        self._rewards: list[float] = []  # train/reward since the previous evaluation
        self._in_a_row = 0
        self._last_step: int | None = None

    def __getattr__(self, name: str) -> Any:  # uri, run_id, copy_metrics, notice ...: the inner tracker's
        return getattr(self.inner, name)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.inner.log_metrics(metrics, step)
        self._check(metrics, step)

    def report_evaluation(self, metrics: Mapping[str, float], step: int) -> None:
        """Metrics an engine logs by itself (VeRL into MLflow, read from its printed lines): checked, not logged."""
        report = getattr(self.inner, "report_evaluation", None)  # a tune trial's
        if report is not None:
            report(metrics, step)
        self._check(metrics, step)

    def log_per_problem(self, dataset: str, step: int, accuracies: Sequence[float], **samples: Any) -> None:
        self.inner.log_per_problem(dataset, step, accuracies, **samples)

    def _check(self, metrics: Mapping[str, float], step: int) -> None:
        reward = metrics.get("train/reward")
        if reward is not None and math.isfinite(float(reward)):
            self._rewards.append(float(reward))
        scores = [float(v) for name, v in metrics.items() if name.startswith("eval/")]
        if not scores or (self._last_step is not None and step <= self._last_step) or not self._rewards:
            return  # no evaluation; one seen already (a resumed engine validates again); no training before it
        mean_reward = sum(self._rewards) / len(self._rewards)
        self._rewards, self._last_step = [], step
        collapsed = mean_reward < self.rule.reward_below and all(s < self.rule.eval_below for s in scores)
        self._in_a_row = self._in_a_row + 1 if collapsed else 0
        if self._in_a_row >= self.rule.evaluations:
            raise Collapsed(f"{REASON_PREFIX} at step {step}: reward {mean_reward:.2f}, avg@16 "
                            f"{100 * max(scores):.1f}% for {self._in_a_row} evaluations")  # fmt: skip


def rule_tracker(tracker: Any, config: Mapping[str, Any]) -> Any:
    """The tracker a job hands its backend: `tracker`, held to the run's collapse rule where it declares one."""
    rule = collapse_rule(config)
    return tracker if rule is None else RuleTracker(tracker, rule)
