"""What `pdmctl seeds`' rule is expected to do from here: the seeds at which it stops and how often its
final interval covers, simulated with the rule's own pieces.

The rule is the one `seeds` applies at each look (`budget.seeds.propose`): a comparison whose
group-sequential interval (`report.sequential`) leaves out 0 stops; otherwise it gets the seeds at which
the paired t-test at the next stage's level reaches 80% power at the difference and spread seen so far
(`report.power.seeds_needed`, at least one more), up to the cap; it stops at the cap or where no number
of seeds reaches that power. Future per-seed differences are drawn normal at the observed difference
and spread; the seeds already there stay as they are. The draws are seeded: the same look states the
same expectation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

DRAWS = 2000  # simulated continuations of a comparison
SEED = 20240917  # the draws' seed


@dataclass(frozen=True)
class Expectation:
    seeds: float  # the mean number of matched seeds at which the rule stops
    coverage: float  # the share of draws whose final interval covers the simulated difference


@lru_cache(maxsize=4096)
def _half_factor(n: int, stage: int, alpha: float) -> float:
    """Stage `stage`'s half width over n seeds for a unit spread (report.sequential.stage_half_widths)."""
    from pdmctl.report.sequential import stage_half_widths

    return float(stage_half_widths(np.array(1.0), np.array(n), np.array(stage), alpha))


@lru_cache(maxsize=8192)
def _needed(effect: float, stage: int, alpha: float) -> int | None:
    from pdmctl.report import power
    from pdmctl.report.sequential import stage_alpha

    return power.seeds_needed(effect, paired=True, alpha=stage_alpha(stage, alpha))


def _interval(x: np.ndarray, stage_of: np.ndarray, alpha: float) -> tuple[float, float, int]:
    """The intersection of the stages' intervals over `x` (as report.sequential.sequential_interval)."""
    low, high = -math.inf, math.inf
    count = int(stage_of.max())
    for j in range(1, count + 1):
        y = x[stage_of <= j]
        if y.size < 2:
            continue
        half = _half_factor(int(y.size), j, alpha) * float(y.std(ddof=1))
        low, high = max(low, float(y.mean()) - half), min(high, float(y.mean()) + half)
    if low > high:  # the stages disagree: the last stage's interval stands
        half = _half_factor(int(x.size), count, alpha) * float(x.std(ddof=1))
        low, high = float(x.mean()) - half, float(x.mean()) + half
    return low, high, count


def simulate_rule(start: Sequence[float] | int, effect: float, sd: float, alpha: float, max_seeds: int,
                  *, stages: Sequence[int] | None = None, draws: int = DRAWS, seed: int = SEED) -> Expectation:  # fmt: skip
    """The rule from `start` (the per-seed differences already there, with their `stages`; or a number of
    first seeds, drawn as well) on to its stop, `draws` times, differences normal(effect, sd)."""
    rng = np.random.default_rng(seed)
    fixed = None if isinstance(start, int) else np.asarray(start, dtype=float)
    fixed_stages = None if fixed is None else np.asarray(stages if stages is not None else [1] * fixed.size)
    stopped, covered = np.zeros(draws), np.zeros(draws, bool)
    for i in range(draws):
        if fixed is None:
            x, stage_of = rng.normal(effect, sd, int(start)), np.ones(int(start), dtype=int)
        else:
            x, stage_of = fixed, fixed_stages
        while True:
            low, high, stage = _interval(x, stage_of, alpha) if x.size >= 2 else (-math.inf, math.inf, 1)
            if low > 0 or high < 0:
                break
            spread = float(x.std(ddof=1)) if x.size >= 2 else math.nan
            if not spread > 0:
                break
            needed = _needed(round(abs(float(x.mean())) / spread, 2), stage + 1, alpha)
            extra = 0 if needed is None else min(max(1, needed - x.size), max_seeds - x.size)
            if extra <= 0:
                break
            x = np.concatenate([x, rng.normal(effect, sd, extra)])
            stage_of = np.concatenate([stage_of, np.full(extra, stage + 1)])
        stopped[i], covered[i] = x.size, low <= effect <= high
    return Expectation(float(stopped.mean()), float(covered.mean()))
