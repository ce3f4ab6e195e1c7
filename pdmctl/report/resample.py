"""Resampling: bootstrap confidence intervals over seeds (scipy.stats.bootstrap) and over seeds and problems.

Every function takes the random seed from `Confidence`, so the same data always gives the same interval.
scipy draws one set of resample indices per call and applies it to every slice of a batch, so a batch
of same-sized samples gives each slice exactly the interval a call on that slice alone would give;
`seed_intervals` groups by size for speed without changing a single number.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from scipy import stats as sps

from pdmctl.report.definition import Confidence
from pdmctl.report.stats import Comparison, Estimate, Interval, mean, probability_of_improvement

_SCIPY_METHOD = {"percentile": "percentile", "bca": "BCa"}
_CHUNK = 2_000_000  # values per vectorised step (rows × resamples × seeds): bounds memory, changes no number


def _mean(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis)


def _mean_difference(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def _batch(data: tuple[np.ndarray, ...], conf: Confidence) -> int:
    values = max(a.size for a in data)
    return int(min(conf.resamples, max(10, _CHUNK // max(values, 1))))


def _bootstrap(
    data: tuple[np.ndarray, ...], statistic, conf: Confidence, method: str
) -> tuple[np.ndarray, ...]:
    with warnings.catch_warnings():  # BCa on constant data warns and answers NaN; handled by the caller
        warnings.simplefilter("ignore")
        result = sps.bootstrap(
            data, statistic, n_resamples=conf.resamples, batch=_batch(data, conf), vectorized=True, axis=-1,
            confidence_level=conf.level, method=_SCIPY_METHOD[method], rng=np.random.default_rng(conf.seed),
        )  # fmt: skip
    return np.atleast_1d(result.confidence_interval.low), np.atleast_1d(result.confidence_interval.high)


def bootstrap_mean(samples: np.ndarray, conf: Confidence) -> tuple[np.ndarray, np.ndarray]:
    """Intervals of the mean of each row of `samples` (rows × seeds, at least 2 seeds).

    BCa is undefined where a row is constant (its jackknife has no spread); such rows fall back to the
    percentile interval, which there is the single value itself.
    """
    low, high = _bootstrap((samples,), _mean, conf, conf.method)
    undefined = ~(np.isfinite(low) & np.isfinite(high))
    if conf.method != "percentile" and undefined.any():
        low[undefined], high[undefined] = _bootstrap((samples[undefined],), _mean, conf, "percentile")
    return low, high


def seed_intervals(samples: Sequence[Sequence[float]], conf: Confidence) -> list[Estimate]:
    """Mean over seeds and its bootstrap interval for each sample; n/a (None) below two seeds."""
    by_size: dict[int, list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_size[len(sample)].append(i)
    intervals: list[Interval | None] = [None] * len(samples)
    for size, idx in by_size.items():
        if size < 2:
            continue
        low, high = bootstrap_mean(np.array([samples[i] for i in idx], dtype=float), conf)
        for i, lo, hi in zip(idx, low, high, strict=True):
            intervals[i] = Interval(float(lo), float(hi))
    return [Estimate(mean(s), len(s), iv) for s, iv in zip(samples, intervals, strict=True)]


def seed_interval(sample: Sequence[float], conf: Confidence) -> Estimate:
    return seed_intervals([sample], conf)[0]


def bands(curves: Sequence[np.ndarray], conf: Confidence) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Mean and interval at every step of each seeds × steps array (learning curves' shaded bands), in one
    bootstrap per number of seeds. With one seed the band is NaN (not drawn), never a zero-width band."""
    out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    by_seeds: dict[int, list[int]] = defaultdict(list)
    for i, values in enumerate(curves):
        centre = values.mean(axis=0)
        out.append((centre, np.full_like(centre, np.nan), np.full_like(centre, np.nan)))
        if values.shape[0] >= 2 and values.shape[1]:
            by_seeds[values.shape[0]].append(i)
    for idx in by_seeds.values():
        low, high = bootstrap_mean(np.concatenate([curves[i].T for i in idx]), conf)
        ends = np.cumsum([curves[i].shape[1] for i in idx])[:-1]
        for i, lo, hi in zip(idx, np.split(low, ends), np.split(high, ends), strict=True):
            out[i] = (out[i][0], lo, hi)
    return out


def compare_unpaired(x: Sequence[float], baseline: Sequence[float], conf: Confidence) -> Comparison:
    """The mask's mean minus the baseline's when no seed pairs: each side's runs resampled on their own;
    P(improvement) over all pairs of runs. (Paired differences are plain samples for `seed_intervals`.)"""
    difference = mean(x) - mean(baseline)
    interval = None
    if len(x) >= 2 and len(baseline) >= 2:
        data = (np.asarray(x, dtype=float), np.asarray(baseline, dtype=float))
        low, high = _bootstrap(data, _mean_difference, conf, conf.method)
        if not (math.isfinite(low[0]) and math.isfinite(high[0])):  # BCa on constant data
            low, high = _bootstrap(data, _mean_difference, conf, "percentile")
        interval = Interval(float(low[0]), float(high[0]))
    return Comparison(Estimate(difference, len(x), interval), probability_of_improvement(x, baseline), False,
                      len(baseline))  # fmt: skip


def two_level_interval(scores: Sequence[np.ndarray], conf: Confidence) -> Estimate:
    """Bootstrap over seeds, then over problems within each drawn seed (percentile interval).

    `scores[d]` is seeds × problems for data set d (the same seeds in the same order in every data set);
    the statistic is the mean over data sets of each data set's mean over seeds and problems, which with
    the full data equals the seed-level mean of the logged avg@16.
    """
    n_seeds = scores[0].shape[0]
    point = float(np.mean([s.mean() for s in scores]))
    if n_seeds < 2:
        return Estimate(point, n_seeds, None)
    rng = np.random.default_rng(conf.seed)
    seeds = rng.integers(0, n_seeds, (conf.resamples, n_seeds))
    per_dataset = []
    for data in scores:
        problems = rng.integers(0, data.shape[1], (conf.resamples, n_seeds, data.shape[1]))
        per_dataset.append(data[seeds[:, :, None], problems].mean(axis=(1, 2)))
    distribution = np.mean(per_dataset, axis=0)
    alpha = (1 - conf.level) / 2
    low, high = np.quantile(distribution, [alpha, 1 - alpha])
    return Estimate(point, n_seeds, Interval(float(low), float(high)))
