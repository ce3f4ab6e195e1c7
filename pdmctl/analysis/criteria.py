"""The two criteria compared on the disagreement tokens: per seed who kept which token and its ΔD, then
the unsafe and corrective keep rates over seeds, and the estimators' paired differences."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdmctl.analysis.results import Comparison, CriterionStats, EstimatorDifference


@dataclass(frozen=True)
class _SeedTokens:
    """One seed's disagreement tokens for one estimator: who keeps them and ΔD under each update."""

    ratio_kept_delta_d: torch.Tensor
    predictive_kept_delta_d: torch.Tensor
    disagreements: int


ESTIMATOR_PAIRS = (("uni", "agg"), ("exact", "agg"), ("exact", "uni"))


def _estimator_differences(comparisons: list[Comparison], level: float = 0.95) -> list[EstimatorDifference]:
    from pdmctl.report.stats import paired_difference

    by_estimator = {c.estimator: c.predictive for c in comparisons}
    found = []
    for measure, field in (("unsafe-keep", "unsafe_keep_per_seed"), ("corrective", "corrective_per_seed")):
        for first, second in ESTIMATOR_PAIRS:
            pairs = [
                (a, b)
                for a, b in zip(
                    getattr(by_estimator[first], field), getattr(by_estimator[second], field), strict=True
                )
                if a is not None and b is not None
            ]
            estimate = (
                paired_difference([a for a, _ in pairs], [b for _, b in pairs], level) if pairs else None
            )
            interval = estimate.interval if estimate is not None else None
            found.append(
                EstimatorDifference(
                    measure=measure,
                    first=first,
                    second=second,
                    mean=estimate.mean if estimate is not None else None,
                    low=interval.low if interval is not None else None,
                    high=interval.high if interval is not None else None,
                    seeds=len(pairs),
                )
            )
    return found


def _criterion(kept_delta_d: list[torch.Tensor]) -> CriterionStats:
    rates = [float((dd > 0).float().mean()) if dd.numel() else None for dd in kept_delta_d]
    defined = [r for r in rates if r is not None]
    mean = sum(defined) / len(defined) if defined else None
    se = (
        math.sqrt(sum((r - mean) ** 2 for r in defined) / (len(defined) - 1) / len(defined))
        if mean is not None and len(defined) > 1
        else None
    )
    pooled = torch.cat(kept_delta_d)
    return CriterionStats(
        corrective_per_seed=[float((dd < 0).float().mean()) if dd.numel() else None for dd in kept_delta_d],
        unsafe_keep_per_seed=rates,
        unsafe_keep_mean=mean,
        unsafe_keep_se=se,
        corrective_pooled=float((pooled < 0).float().mean()) if pooled.numel() else None,
        kept_pooled=int(pooled.numel()),
        kept_per_seed=[int(dd.numel()) for dd in kept_delta_d],
    )


def _compare(estimator: str, seeds: list[_SeedTokens]) -> Comparison:
    ratio = _criterion([s.ratio_kept_delta_d for s in seeds])
    predictive = _criterion([s.predictive_kept_delta_d for s in seeds])
    both = [
        (r, p)
        for r, p in zip(ratio.unsafe_keep_per_seed, predictive.unsafe_keep_per_seed, strict=True)
        if r is not None and p is not None
    ]
    return Comparison(
        estimator=estimator,
        disagreement_per_seed=[s.disagreements for s in seeds],
        ratio=ratio,
        predictive=predictive,
        predictive_wins=sum(p < r for r, p in both),
        ratio_wins=sum(r < p for r, p in both),
        seeds_compared=len(both),
    )
