"""How many seeds a comparison needs: the power of the report's own t-tests.

The comparison table tests "no difference" with a two-sided t-test at level α: paired (one-sample t
on the per-seed differences, n − 1 degrees of freedom) where the seeds match, Welch's otherwise. Under
a true difference Δ with seed standard deviation σ, the paired statistic follows a noncentral t
distribution with n − 1 degrees of freedom and noncentrality (Δ/σ)·√n, so its power is exactly

    P(|T| > t_{n−1, 1−α/2}),  T ~ t'(n − 1, (Δ/σ)·√n)

(scipy.stats.nct; what statsmodels' TTestPower computes, statsmodels not being a dependency here).
For two independent groups of n_x and n_y seeds with a common σ: n_x + n_y − 2 degrees of freedom,
noncentrality (Δ/σ) / √(1/n_x + 1/n_y) (Student's; Welch's test has close to this power).

From it: `seeds_needed`, the smallest n whose power reaches the target (80%) at the observed Δ/σ,
and `resolvable`, the smallest |Δ| the present seeds detect with that power. Both take the observed
σ for the true one: with 3 seeds that estimate is itself rough (its 95% interval spans about
0.5σ-6σ), so they are a guide to the next sweep's size, not a guarantee. tests/test_report_power.py
checks by simulation that the promised power is what the test delivers at 3-10 seeds.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize
from scipy import stats as sps

ALPHA, TARGET = 0.05, 0.80
MAX_SEEDS = 1000  # beyond this `seeds_needed` answers None ("more than 1000")


def _df_nc(effect: np.ndarray, n_x: np.ndarray, n_y: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    if n_y is None:  # paired: one sample of n_x differences
        return n_x - 1, effect * np.sqrt(n_x)
    return n_x + n_y - 2, effect / np.sqrt(1 / n_x + 1 / n_y)


def power(effect, n_x, n_y=None, alpha: float = ALPHA):
    """Power of the two-sided t-test at level `alpha` for a standardised difference `effect` = Δ/σ:
    paired with n_x pairs (n_y None), or two groups of n_x and n_y. Broadcasts over its arguments."""
    effect = np.abs(np.asarray(effect, dtype=float))
    n_x = np.asarray(n_x, dtype=float)
    n_y = None if n_y is None else np.asarray(n_y, dtype=float)
    df, nc = _df_nc(effect, n_x, n_y)
    critical = sps.t.ppf(1 - alpha / 2, df)
    # the far tail (rejecting with the wrong sign) is below 1e-9 where scipy's nct answers NaN there
    return sps.nct.sf(critical, df, nc) + np.nan_to_num(sps.nct.cdf(-critical, df, nc), nan=0.0)


def seeds_needed(effect: float, *, paired: bool = True, target: float = TARGET, alpha: float = ALPHA) -> int | None:
    """The smallest number of seeds (pairs; or seeds per mask, unpaired) whose test reaches `target` power
    at the standardised difference `effect`; None where even MAX_SEEDS do not (or effect is 0 or NaN)."""
    if not math.isfinite(effect) or effect == 0:
        return None if not math.isinf(effect) else 2
    n = np.arange(2, MAX_SEEDS + 1)
    reached = power(effect, n, None if paired else n, alpha) >= target
    return int(n[np.argmax(reached)]) if reached.any() else None


def resolvable(n_x: int, n_y: int | None = None, *, target: float = TARGET, alpha: float = ALPHA) -> float:
    """The smallest standardised difference |Δ|/σ the test on these seeds detects with `target` power
    (NaN below two seeds, or two per side)."""
    if n_x < 2 or (n_y is not None and n_y < 2):
        return math.nan
    return float(optimize.brentq(lambda d: float(power(d, n_x, n_y, alpha)) - target, 1e-9, 200.0, xtol=1e-10))
