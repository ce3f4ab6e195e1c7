"""Do the report's intervals cover as often as they say? A simulation over synthetic seed sets.

For every interval `pdmctl report` prints — a row's mean over seeds (and the learning curves' bands, the
same interval at every step), a paired difference against the baseline, an unpaired one — draw
DATASETS synthetic data sets with a known truth at n = 3, 5 and 10 seeds, compute the interval with the
report's own functions, and count how often it holds the truth. The default (Student's t; Welch's
unpaired) must cover 95% ± 2%; the percentile bootstrap, kept as an option, does not at 3 seeds.

    python tests/test_report_coverage.py    # the table of every method's coverage
"""

from __future__ import annotations

import numpy as np
import pytest

from pdmctl.report import intervals, resample
from pdmctl.report.definition import CI_METHODS, T_METHOD, Confidence
from pdmctl.report.stats import welch_intervals

DATASETS = 2000  # per n: the coverage's standard error is 0.5 points at 95%
SEEDS = (3, 5, 10)
LEVEL = 0.95
TRUE_MEAN, SEED_SD = 0.30, 0.05  # avg@16 of one configuration: its mean over seeds and their spread
TRUE_DIFF = 0.02


def conf(method: str) -> Confidence:
    return Confidence(level=LEVEL, method=method, resamples=1000, seed=1)


def _covered(lows: np.ndarray, highs: np.ndarray, truth: float) -> float:
    return float(np.mean((lows <= truth) & (truth <= highs)))


def seed_mean_coverage(method: str, n: int, rng: np.random.Generator) -> float:
    """The results table's cell: the mean of n seeds' avg@16."""
    samples = rng.normal(TRUE_MEAN, SEED_SD, (DATASETS, n))
    estimates = intervals.seed_intervals(samples.tolist(), conf(method))
    return _covered(np.array([e.interval.low for e in estimates]), np.array([e.interval.high for e in estimates]),
                    TRUE_MEAN)  # fmt: skip


def band_coverage(method: str, n: int, rng: np.random.Generator) -> float:
    """A learning curve's band: each of DATASETS steps is one data set of n seeds (pointwise coverage)."""
    curve = rng.normal(TRUE_MEAN, SEED_SD, (n, DATASETS))
    _, low, high = intervals.bands([curve], conf(method))[0]
    return _covered(low, high, TRUE_MEAN)


def paired_coverage(method: str, n: int, rng: np.random.Generator) -> float:
    """The comparison table's paired cell: a seed effect both masks share, the mask TRUE_DIFF better."""
    seed_effect = rng.normal(TRUE_MEAN, SEED_SD, (DATASETS, n))
    baseline = seed_effect + rng.normal(0, 0.01, (DATASETS, n))
    mask = seed_effect + TRUE_DIFF + rng.normal(0, 0.01, (DATASETS, n))
    estimates = intervals.seed_intervals((mask - baseline).tolist(), conf(method))
    return _covered(np.array([e.interval.low for e in estimates]), np.array([e.interval.high for e in estimates]),
                    TRUE_DIFF)  # fmt: skip


def unpaired_coverage(method: str, n: int, rng: np.random.Generator) -> float:
    """The comparison table's unpaired cell: no seed in common, and the two masks' spreads differ.

    The t method's data sets go to `welch_intervals` in one call (what `compare_unpaired` computes for
    one); the bootstrap's one at a time, through `compare_unpaired` itself (only `main` asks for them)."""
    mask = rng.normal(TRUE_MEAN + TRUE_DIFF, SEED_SD, (DATASETS, n))
    baseline = rng.normal(TRUE_MEAN, 2 * SEED_SD, (DATASETS, n))
    if method == T_METHOD:
        return _covered(*welch_intervals(mask, baseline, LEVEL), TRUE_DIFF)
    cells = [intervals.compare_unpaired(list(m), list(b), conf(method)).difference.interval
             for m, b in zip(mask, baseline, strict=True)]  # fmt: skip
    return _covered(np.array([c.low for c in cells]), np.array([c.high for c in cells]), TRUE_DIFF)


KINDS = {
    "seed mean": seed_mean_coverage,
    "band": band_coverage,
    "paired difference": paired_coverage,
    "unpaired difference": unpaired_coverage,
}


@pytest.mark.parametrize("n", SEEDS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_default_interval_covers_95_percent(kind: str, n: int) -> None:
    default = Confidence().method
    coverage = KINDS[kind](default, n, np.random.default_rng(n))
    assert 0.93 <= coverage <= 0.97, f"{kind}, {default}, n={n}: coverage {coverage:.3f}"


def test_the_percentile_bootstrap_undercovers_with_three_seeds() -> None:
    """Why it is not the default: the same check fails for it (73% where 95% is promised)."""
    coverage = seed_mean_coverage("percentile", 3, np.random.default_rng(3))
    assert coverage < 0.93, coverage


def two_level_coverage(n: int, rng: np.random.Generator, problems: int = 30) -> float:
    """`--two-level`: each seed's per-problem scores are a seed effect plus a problem effect plus noise; the
    truth is the mean over seeds and over the problems' population."""
    covered = 0
    for _ in range(DATASETS):
        scores = (TRUE_MEAN + rng.normal(0, SEED_SD, (n, 1)) + rng.normal(0, 0.1, (1, problems))
                  + rng.normal(0, 0.05, (n, problems)))  # fmt: skip
        iv = resample.two_level_interval([scores], conf("percentile")).interval
        covered += iv.low <= TRUE_MEAN <= iv.high
    return covered / DATASETS


def main() -> None:
    print(f"coverage of nominal {LEVEL:.0%} intervals, {DATASETS} synthetic data sets per cell")
    for kind, fn in KINDS.items():
        for method in CI_METHODS:
            cells = [f"n={n}: {fn(method, n, np.random.default_rng(n)):.3f}" for n in SEEDS]
            print(f"{kind:20s} {method:10s} " + "  ".join(cells))
    cells = [f"n={n}: {two_level_coverage(n, np.random.default_rng(n)):.3f}" for n in SEEDS]
    print(f"{'seed mean':20s} {'two-level':10s} " + "  ".join(cells) + "  (--two-level; not asserted)")


if __name__ == "__main__":
    main()


@pytest.mark.parametrize("n", [3, 5, 20])
def test_the_direction_analysis_estimator_differences_cover(n: int) -> None:
    """`pdmctl analyze` prints paired differences between estimators (uni − agg, ...) over seeds. Per seed
    each rate is a proportion among 40-200 disagreement tokens around a seed-level rate the estimators
    share, as in the analysis; the 95% t-interval of the per-seed differences must cover the true
    difference 95% ± 2% of the time."""
    from pdmctl.analysis.criteria import _estimator_differences
    from pdmctl.analysis.results import Comparison, CriterionStats

    rng = np.random.default_rng(12)
    truth = {"agg": 0.80, "uni": 0.74, "exact": 0.71}  # mean unsafe-keep rate of each estimator
    covered = {}
    for _ in range(DATASETS // 2):
        seed_effect = rng.normal(0, 0.05, n)
        comparisons = []
        for estimator, p in truth.items():
            tokens = rng.integers(40, 200, n)
            rates = rng.binomial(tokens, np.clip(p + seed_effect, 0, 1)) / tokens
            stats = CriterionStats(list(rates), None, None, None, 0, list(1 - rates))
            comparisons.append(Comparison(estimator, [], stats, stats, 0, 0, n))
        for d in _estimator_differences(comparisons):
            sign = 1 if d.measure == "unsafe-keep" else -1
            true = sign * (truth[d.first] - truth[d.second])
            covered.setdefault((d.measure, d.first, d.second), []).append(d.low <= true <= d.high)
    rates = {key: float(np.mean(v)) for key, v in covered.items()}
    assert all(0.93 <= r <= 0.97 for r in rates.values()), rates
