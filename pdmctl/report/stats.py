"""The report's statistics as small pure functions: no resampling (see `resample`), no I/O, no plotting.

Values are avg@16 fractions in [0, 1]; the tables print them as percentages.

The default interval is Student's t: for the mean of n seeds, `mean ± t_{n−1, 1−α/2} · s / √n`; for a
paired comparison the same on the per-seed differences; for an unpaired one Welch's interval. With
normal seed-to-seed noise they cover at their level for every n ≥ 2, where a percentile bootstrap over
3 to 10 seeds covers 73 to 90% at a nominal 95% (it resamples a sample too small to show its own
spread). The simulation in tests/test_report_coverage.py checks both.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from pdmctl.report.definition import At

Series = Sequence[tuple[int, float]]  # (step, value), sorted by step


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    @property
    def width(self) -> float:
        return self.high - self.low


@dataclass(frozen=True)
class Estimate:
    """A mean over seeds with its confidence interval; `interval` is None (n/a) below two values."""

    mean: float
    n: int
    interval: Interval | None


@dataclass(frozen=True)
class Comparison:
    """A mask against the baseline on one column: the difference of means, its interval, P(improvement)."""

    difference: Estimate
    probability_of_improvement: float
    paired: bool  # matched by seed (otherwise: all pairs of runs)
    n_baseline: int
    p_value: float = math.nan  # two-sided t-test of no difference (paired t, or Welch's); NaN: no test
    p_holm: float = math.nan  # p adjusted by Holm's procedure over the table's family (one column)
    spread: float = math.nan  # the seeds' standard deviation the test sees (of the differences; pooled)
    seeds_needed: int | None = None  # seeds (pairs) for 80% power at 5% at the observed difference (power)
    resolvable: float = math.nan  # the smallest |difference| the present seeds detect with 80% power


def mean(values: Sequence[float]) -> float:
    """Plain Python: the report takes hundreds of thousands of means of a few numbers each."""
    return sum(values) / len(values) if len(values) else math.nan


def common_steps(series: Mapping[str, Series]) -> list[int]:
    """The evaluation steps at which every column has a value."""
    steps = [{s for s, _ in points} for points in series.values()]
    return sorted(set.intersection(*steps)) if steps else []


def select_steps(scores: Mapping[int, float], at: At) -> list[int]:
    """The evaluation steps a run's table value is read at, given its per-step score (the columns' mean).

    `best` never picks a step whose score is NaN; a run whose every score is NaN gets its final step.
    """
    steps = sorted(scores)
    if not steps:
        return []
    if at.kind == "final":
        return steps[-1:]
    if at.kind == "last":
        return steps[-at.n :]
    finite = [s for s in steps if math.isfinite(scores[s])]
    return [max(finite, key=lambda s: (scores[s], s))] if finite else steps[-1:]


def values_at(series: Mapping[str, Series], at: At) -> tuple[dict[str, float], list[int]]:
    """A run's value per column (mean over the selected steps) and those steps."""
    steps = common_steps(series)
    by_step = {label: dict(points) for label, points in series.items()}
    if at.kind == "best":
        scores = {s: mean([by_step[label][s] for label in series]) for s in steps}
    else:  # only the order of the steps matters
        scores = dict.fromkeys(steps, 0.0)
    chosen = select_steps(scores, at)
    return {label: mean([by_step[label][s] for s in chosen]) for label in series}, chosen


def probability_of_improvement_paired(differences: Sequence[float]) -> float:
    """Share of matched seeds on which the mask beats the baseline; a tie counts half."""
    d = np.asarray(differences, dtype=float)
    return float(np.mean((d > 0) + 0.5 * (d == 0))) if d.size else math.nan


def probability_of_improvement(x: Sequence[float], y: Sequence[float]) -> float:
    """P(X > Y) over all pairs of runs (Mann-Whitney's U / (n m), rliable's definition); a tie counts half."""
    a, b = np.asarray(x, dtype=float)[:, None], np.asarray(y, dtype=float)[None, :]
    return float(np.mean((a > b) + 0.5 * (a == b))) if a.size and b.size else math.nan


def t_intervals(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Student's t interval of the mean of each row of `samples` (rows × n values, n >= 2)."""
    n = samples.shape[-1]
    centre = samples.mean(axis=-1)
    half = sps.t.ppf(0.5 + level / 2, n - 1) * samples.std(axis=-1, ddof=1) / math.sqrt(n)
    return centre - half, centre + half


def t_estimates(samples: Sequence[Sequence[float]], level: float) -> list[Estimate]:
    """Mean and t interval of each sample (of any sizes, one vectorised call per size); n/a (None) below
    two values."""
    by_size: dict[int, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_size[len(sample)].append(i)
    intervals: list[Interval | None] = [None] * len(samples)
    for size, idx in by_size.items():
        if size >= 2:
            low, high = t_intervals(np.array([samples[i] for i in idx], dtype=float), level)
            for i, lo, hi in zip(idx, low.tolist(), high.tolist(), strict=True):
                intervals[i] = Interval(lo, hi)
    return [Estimate(mean(s), len(s), iv) for s, iv in zip(samples, intervals, strict=True)]


def welch_intervals(x: np.ndarray, y: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Welch's t interval of mean(x) − mean(y) for each row of independent samples (rows × n_x, rows × n_y,
    both n >= 2). Two constant samples give the point itself (scipy answers NaN: zero variance, zero
    degrees of freedom)."""
    difference = x.mean(axis=-1) - y.mean(axis=-1)
    constant = (np.ptp(x, axis=-1) == 0) & (np.ptp(y, axis=-1) == 0)
    with warnings.catch_warnings():  # constant rows: scipy warns and answers NaN, replaced below
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = sps.ttest_ind(x, y, axis=-1, equal_var=False).confidence_interval(confidence_level=level)
    return np.where(constant, difference, ci.low), np.where(constant, difference, ci.high)


def welch_interval(x: Sequence[float], y: Sequence[float], level: float) -> Interval | None:
    """`welch_intervals` of one pair of samples; None below two values on a side."""
    if len(x) < 2 or len(y) < 2:
        return None
    low, high = welch_intervals(np.asarray(x, dtype=float), np.asarray(y, dtype=float), level)
    return Interval(float(low), float(high))


def paired_difference(x: Sequence[float], y: Sequence[float], level: float = 0.95) -> Estimate:
    """Mean of the per-seed differences x_i − y_i (x and y matched by position: the same seeds) with its
    Student's t interval at `level`; the interval is None below two pairs."""
    if len(x) != len(y):
        raise ValueError(f"paired_difference: {len(x)} values against {len(y)}; pairs need equal lengths")
    return t_estimates([[a - b for a, b in zip(x, y, strict=True)]], level)[0]


def _t_test_p(t: float, df: float, difference: float) -> float:
    """Two-sided p of a t statistic; with no spread at all the difference is 0 (p = 1) or certain (p = 0)."""
    if not math.isfinite(t):
        return 1.0 if difference == 0 else 0.0
    return float(2 * sps.t.sf(abs(t), df))


def paired_p_value(differences: Sequence[float]) -> float:
    """Two-sided one-sample t-test of mean 0 on the per-seed differences; NaN below two pairs."""
    d = np.asarray(differences, dtype=float)
    if d.size < 2:
        return math.nan
    sd = d.std(ddof=1)
    t = d.mean() / (sd / math.sqrt(d.size)) if sd > 0 else math.inf
    return _t_test_p(t, d.size - 1, float(d.mean()))


def welch_p_value(x: Sequence[float], y: Sequence[float]) -> float:
    """Two-sided Welch's t-test of equal means (no seed in common); NaN below two runs on a side."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.size < 2 or b.size < 2:
        return math.nan
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    difference = float(a.mean() - b.mean())
    if va + vb == 0:
        return _t_test_p(math.inf, 1, difference)
    df = (va + vb) ** 2 / (va**2 / (a.size - 1) + vb**2 / (b.size - 1))  # Welch–Satterthwaite
    return _t_test_p(difference / math.sqrt(va + vb), df, difference)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979) for one family of tests; NaN entries are no test and
    stay NaN (they do not count in the family's size m).

    With the m p-values sorted, p_(1) ≤ … ≤ p_(m): adjusted p_(i) = max_{j ≤ i} min(1, (m − j + 1) p_(j)).
    Rejecting where the adjusted p ≤ α keeps the chance of any false rejection in the family (the
    family-wise error rate) ≤ α, whatever the dependence between the tests (the comparisons of a column
    share the baseline's runs). scipy has no Holm; `scipy.stats.false_discovery_control` is
    Benjamini–Hochberg, which bounds the expected share of false rejections, a weaker guarantee.
    """
    tested = sorted((p, i) for i, p in enumerate(p_values) if math.isfinite(p))
    m = len(tested)
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def format_p(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.2g}" if value < 0.001 else f"{value:.3f}"


def pct(value: float, digits: int = 1) -> str:
    return "n/a" if not math.isfinite(value) else f"{100 * value:.{digits}f}"


def signed_pct(value: float, digits: int = 1) -> str:
    return "n/a" if not math.isfinite(value) else f"{100 * value:+.{digits}f}"


def format_interval(interval: Interval | None, signed: bool = False) -> str:
    fmt = signed_pct if signed else pct
    return "n/a" if interval is None else f"[{fmt(interval.low)}, {fmt(interval.high)}]"


def format_estimate(estimate: Estimate, signed: bool = False) -> str:
    """`34.2 [31.0, 37.5]` in percentage points; `34.2 [n/a]` with one seed; `n/a` with none."""
    if estimate.n == 0:
        return "n/a"
    fmt = signed_pct if signed else pct
    interval = "[n/a]" if estimate.interval is None else format_interval(estimate.interval, signed)
    return f"{fmt(estimate.mean)} {interval}"
