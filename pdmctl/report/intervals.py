"""The interval the report prints, by `Confidence.method`: Student's t (the default, `stats`) or a bootstrap
over seeds (`resample`), with the name every table and figure gives it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdmctl.report import resample
from pdmctl.report.definition import T_METHOD, Confidence
from pdmctl.report.stats import (
    Comparison,
    Estimate,
    probability_of_improvement,
    t_estimates,
    t_intervals,
    welch_interval,
)


def short_name(conf: Confidence) -> str:
    """`95% t` or `95% percentile bootstrap`: what a title, a CSV cell or a figure's band says."""
    kind = "t" if conf.method == T_METHOD else f"{conf.method} bootstrap"
    return f"{100 * conf.level:g}% {kind}"


def describe(conf: Confidence) -> str:
    """The seed-mean interval in a sentence, for the notes under tables and figures."""
    if conf.method == T_METHOD:
        return (f"{100 * conf.level:g}% Student's t interval over seeds: mean ± t · s / sqrt(n), t the "
                f"{0.5 + conf.level / 2:g} quantile of Student's t with n − 1 degrees of freedom, s the seeds' "
                f"standard deviation")  # fmt: skip
    return (f"{100 * conf.level:g}% {conf.method} bootstrap over seeds (scipy.stats.bootstrap, "
            f"{conf.resamples} resamples, seed {conf.seed}): whole runs (seeds) resampled with replacement; "
            f"it covers less than its level with few seeds (about 73% at 3 seeds, 90% at 10, for 95%)")  # fmt: skip


def describe_unpaired(conf: Confidence) -> str:
    if conf.method == T_METHOD:
        return f"{100 * conf.level:g}% Welch t interval (unequal variances)"
    return f"{100 * conf.level:g}% {conf.method} bootstrap, each side's runs resampled on their own"


def seed_intervals(samples: Sequence[Sequence[float]], conf: Confidence) -> list[Estimate]:
    """Mean over seeds and its interval for each sample; n/a (None) below two seeds."""
    if conf.method == T_METHOD:
        return t_estimates(samples, conf.level)
    return resample.seed_intervals(samples, conf)


def bands(curves: Sequence[np.ndarray], conf: Confidence) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Mean and interval at every step of each seeds × steps array; NaN (no band) with one seed."""
    if conf.method != T_METHOD:
        return resample.bands(curves, conf)
    out = []
    for values in curves:
        centre = values.mean(axis=0)
        low, high = np.full_like(centre, np.nan), np.full_like(centre, np.nan)
        if values.shape[0] >= 2 and values.shape[1]:
            low, high = t_intervals(values.T, conf.level)
        out.append((centre, low, high))
    return out


def compare_unpaired(x: Sequence[float], baseline: Sequence[float], conf: Confidence) -> Comparison:
    """The mask's mean minus the baseline's when no seed pairs; P(improvement) over all pairs of runs."""
    if conf.method != T_METHOD:
        return resample.compare_unpaired(x, baseline, conf)
    difference = Estimate(
        float(np.mean(x) - np.mean(baseline)), len(x), welch_interval(x, baseline, conf.level)
    )
    return Comparison(difference, probability_of_improvement(x, baseline), False, len(baseline))


FIXED, SEQUENTIAL, UNPAIRED = "fixed", "group-sequential", "unpaired"  # what a difference's interval is


def sequential_label(level: float, n: int, stage: int, last_look: int) -> str:
    """`95% group-sequential t interval over 5 seeds, stage 2 (seeds added after look 1)`: what `seeds` and the
    report both call the interval of a comparison read as a group-sequential design (`report.sequential`)."""
    added = (f"seeds added after look {last_look}" if last_look else
             f"at {100 * (1 - (1 - level) / 2):g}%: no seeds added to it after looking")  # fmt: skip
    return f"{100 * level:g}% group-sequential t interval over {n} seeds, stage {stage} ({added})"


def comparison_interval(comp, conf: Confidence) -> dict:
    """Which interval a comparison's differences carry: `kind` (fixed, group-sequential, unpaired), `level`,
    `stage` and `after_look` (group-sequential only, else None) and `label`, the words the tables use."""
    first = next(iter(comp.cells.values()))
    n = first.difference.n
    if not comp.seeds:
        kind, label = UNPAIRED, f"{describe_unpaired(conf)} over {n} and {first.n_baseline} runs (unpaired)"
    elif comp.stages:
        kind, label = SEQUENTIAL, sequential_label(conf.level, n, comp.stages, comp.last_look)
    else:
        kind, label = FIXED, f"{short_name(conf)} interval over {n} matched seeds (fixed size)"
    return {"kind": kind, "level": conf.level, "stage": comp.stages or None,
            "after_look": (comp.last_look or None) if comp.stages else None, "label": label}
