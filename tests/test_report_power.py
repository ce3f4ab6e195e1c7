"""Seeds needed (pdmctl.report.power): the power the formula promises is what the report's t-tests deliver.

The simulation draws, for 3 to 10 seeds, many sets of per-seed differences with a known true difference
and spread, runs the report's own two-sided tests on each (vectorised) and counts how often they reject:
the share must match `power` at the effect `resolvable` names (80%) and at other effects.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from pdmctl.report import power

SIMULATIONS = 20_000  # the rejection rate's standard error at 80%: 0.0028
TOLERANCE = 0.012


def _paired_rejections(effect: float, n: int, rng: np.random.Generator) -> float:
    d = rng.normal(effect, 1.0, (SIMULATIONS, n))  # σ = 1: the difference is the effect itself
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    return float((np.abs(t) > sps.t.ppf(1 - power.ALPHA / 2, n - 1)).mean())


def _unpaired_rejections(effect: float, n: int, rng: np.random.Generator) -> float:
    x, y = rng.normal(effect, 1.0, (SIMULATIONS, n)), rng.normal(0.0, 1.0, (SIMULATIONS, n))
    pooled = np.sqrt((x.var(axis=1, ddof=1) + y.var(axis=1, ddof=1)) / 2)
    t = (x.mean(axis=1) - y.mean(axis=1)) / (pooled * math.sqrt(2 / n))  # Student's two-sample t
    return float((np.abs(t) > sps.t.ppf(1 - power.ALPHA / 2, 2 * n - 2)).mean())


def test_the_promised_power_is_delivered_at_3_to_10_seeds() -> None:
    rng = np.random.default_rng(29)
    for n in range(3, 11):
        at_80 = power.resolvable(n)
        assert float(power.power(at_80, n)) == pytest.approx(power.TARGET, abs=1e-6)
        assert power.seeds_needed(at_80 * 1.001) == n and power.seeds_needed(at_80 * 0.999) > n
        for effect in (at_80, 0.5 * at_80, 1.0):
            simulated = _paired_rejections(effect, n, rng)
            assert simulated == pytest.approx(float(power.power(effect, n)), abs=TOLERANCE), (n, effect)
        unpaired = power.resolvable(n, n)
        assert _unpaired_rejections(unpaired, n, rng) == pytest.approx(power.TARGET, abs=TOLERANCE), n
    # no difference: the test rejects at its level, and no number of seeds resolves it
    assert _paired_rejections(0.0, 5, rng) == pytest.approx(power.ALPHA, abs=TOLERANCE)
    assert power.seeds_needed(0.0) is None and power.seeds_needed(math.nan) is None
    assert power.seeds_needed(math.inf) == 2  # a difference with no spread at all
    # the textbook values (Cohen 1988): d = 0.5 needs 34 pairs, or 64 per group unpaired
    assert power.seeds_needed(0.5) == 34 and power.seeds_needed(0.5, paired=False) == 64
    assert math.isnan(power.resolvable(1))


def test_seeds_that_do_not_vary_give_no_power_claim() -> None:
    """A collapsed run scores 0 on every seed (the tiny engine model at the preset's lr): the
    t-test is undefined there, so no seeds needed and no resolvable difference, said as such."""
    from pdmctl.report.build import with_power
    from pdmctl.report.stats import Comparison, Estimate, Interval
    from pdmctl.report.tables import _needed_cells

    for diffs, baseline in (([0.0, 0.0], None), ([0.1, 0.1, 0.1], None), ([0.2, 0.2], [0.2, 0.2])):
        comparison = Comparison(Estimate(float(np.mean(diffs)), len(diffs), Interval(0.0, 0.0)), 0.5, baseline is None, 2)
        out = with_power(comparison, diffs, baseline)
        assert out.spread == 0 and out.seeds_needed is None and math.isnan(out.resolvable)
        assert _needed_cells(out) == ("n/a: the seeds do not vary", "n/a")  # seeds needed, resolvable |Δ|
    varying = with_power(Comparison(Estimate(0.1, 3, Interval(0.0, 0.2)), 0.5, True, 3), [0.0, 0.1, 0.2])
    assert varying.spread > 0 and varying.seeds_needed is not None and varying.resolvable > 0
