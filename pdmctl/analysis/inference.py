"""The direction analysis's inference: the primary metric, named before the run, with its
two intervals, and every secondary comparison with its Holm-adjusted p over one family.

The primary metric (docs/results/analysis.md, "The primary metric"): under the `counterfactual`
protocol, on the disagreement tokens of the `exact` estimator, the predictive criterion's unsafe-keep
rate minus the ratio criterion's, each pooled over the tokens it keeps (all seeds together: Σ unsafe /
Σ kept); its 95% interval from a seed-cluster bootstrap (seeds resampled with replacement, the pooled
difference recomputed, the 2.5 and 97.5 percentiles; 10,000 resamples, generator seeded 27). Beside it,
the mean over seeds of the per-seed difference (seeds where both criteria keep some disagreement token)
with its Student's t interval, and a warning when the two estimates differ in sign (the aggregation
decides the verdict: the pooled one weighs seeds by their tokens, the per-seed one weighs them equally).

The secondary comparisons: every other (protocol, estimator) unsafe-keep difference predictive − ratio,
and under `counterfactual` the region-unsafe-keep difference (disagreement tokens) and the needless-mask
difference (the out-of-region sample: on the disagreement tokens one criterion's masks are the other's keeps),
each as the mean of the per-seed differences with a two-sided paired t-test, the p's Holm-adjusted over
the whole family — every analysis given together (`pdmctl analyze --family OTHER.json`: both presets).
Holm is `pdmctl.report.stats.holm` (scipy has no Holm; its `false_discovery_control` is Benjamini-Hochberg).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pdmctl.analysis.results import AnalysisResult

PRIMARY_PROTOCOL, PRIMARY_ESTIMATOR = "counterfactual", "exact"
# not evidence: own-grad's ΔD is the criterion's own first-order prediction pushed through the
# network, so its sign is sign(A·Ḋ) by construction; printed beside the others, never tested
NOT_EVIDENCE = ("own-grad",)
RESAMPLES, BOOTSTRAP_SEED, LEVEL = 10_000, 27, 0.95


def pooled_difference(up_a, n_a, up_b, n_b) -> float:
    """Σ up_a / Σ n_a − Σ up_b / Σ n_b (per-seed counts); NaN where a side has no token."""
    na, nb = float(np.sum(n_a)), float(np.sum(n_b))
    if na == 0 or nb == 0:
        return math.nan
    return float(np.sum(up_a)) / na - float(np.sum(up_b)) / nb


def cluster_bootstrap(
    up_a, n_a, up_b, n_b, *, level: float = LEVEL, resamples: int = RESAMPLES, rng: np.random.Generator | None = None
) -> tuple[float, float]:
    """The seed-cluster percentile bootstrap interval of `pooled_difference`: seeds drawn with replacement
    (a seed's tokens travel together), the pooled difference recomputed on each resample; resamples where
    a side has no token are dropped. (NaN, NaN) below two seeds."""
    arrays = [np.asarray(x, dtype=float) for x in (up_a, n_a, up_b, n_b)]
    seeds = len(arrays[0])
    if seeds < 2:
        return math.nan, math.nan
    rng = rng if rng is not None else np.random.default_rng(BOOTSTRAP_SEED)
    idx = rng.integers(0, seeds, size=(resamples, seeds))
    ua, na, ub, nb = (x[idx].sum(1) for x in arrays)
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = ua / na - ub / nb
    stats = stats[np.isfinite(stats)]
    if not stats.size:
        return math.nan, math.nan
    alpha = (1 - level) / 2
    return float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def _rates(up, n) -> list[float | None]:
    return [u / k if k else None for u, k in zip(up, n, strict=True)]


def _per_seed(a: list[float | None], b: list[float | None]) -> list[float]:
    return [x - y for x, y in zip(a, b, strict=True) if x is not None and y is not None]


@dataclass(frozen=True)
class PrimaryMetric:
    label: str  # the analysis (preset)
    pooled: float  # predictive − ratio unsafe-keep rate, tokens pooled over seeds (NaN: not measured)
    low: float  # seed-cluster bootstrap interval
    high: float
    kept_predictive: int  # disagreement tokens each criterion keeps, all seeds
    kept_ratio: int
    per_seed_mean: float  # mean of the per-seed differences (NaN: no seed with both rates)
    t_low: float  # its Student's t interval (NaN below two seeds)
    t_high: float
    seeds_compared: int
    seeds: int

    @property
    def warning(self) -> str | None:
        if not (math.isfinite(self.pooled) and math.isfinite(self.per_seed_mean)):
            return None
        if (self.pooled > 0) != (self.per_seed_mean > 0) and self.pooled != 0 and self.per_seed_mean != 0:
            return (f"WARNING {self.label}: the pooled difference ({100 * self.pooled:+.1f}) and the per-seed mean "
                    f"({100 * self.per_seed_mean:+.1f}) disagree in sign: the aggregation decides the verdict")  # fmt: skip
        return None


def _counts(result: AnalysisResult, estimator: str, criterion: str, tokens: str, decision: str):
    for c in result.counterfactual:
        if (c.estimator, c.criterion, c.tokens, c.decision) == (estimator, criterion, tokens, decision):
            return c
    return None


def label_of(result: AnalysisResult) -> str:
    return result.model or "analysis"


def primary_metric(result: AnalysisResult, *, resamples: int = RESAMPLES) -> PrimaryMetric:
    from pdmctl.report.stats import paired_difference

    pred = _counts(result, PRIMARY_ESTIMATOR, "predictive", "disagreement", "kept")
    ratio = _counts(result, PRIMARY_ESTIMATOR, "ratio", "disagreement", "kept")
    nan = math.nan
    if pred is None or ratio is None:
        return PrimaryMetric(label_of(result), nan, nan, nan, 0, 0, nan, nan, nan, 0, len(result.seeds))
    pooled = pooled_difference(pred.own_up, pred.n, ratio.own_up, ratio.n)
    low, high = cluster_bootstrap(pred.own_up, pred.n, ratio.own_up, ratio.n, resamples=resamples)
    diffs = _per_seed(_rates(pred.own_up, pred.n), _rates(ratio.own_up, ratio.n))
    estimate = paired_difference(diffs, [0.0] * len(diffs)) if diffs else None
    interval = estimate.interval if estimate is not None else None
    return PrimaryMetric(
        label=label_of(result),
        pooled=pooled,
        low=low,
        high=high,
        kept_predictive=sum(pred.n),
        kept_ratio=sum(ratio.n),
        per_seed_mean=estimate.mean if estimate is not None else nan,
        t_low=interval.low if interval is not None else nan,
        t_high=interval.high if interval is not None else nan,
        seeds_compared=len(diffs),
        seeds=len(result.seeds),
    )


@dataclass(frozen=True)
class Secondary:
    label: str
    protocol: str
    estimator: str
    measure: str  # "unsafe-keep"; counterfactual: "region unsafe-keep", "needless mask (sample)"
    mean: float  # mean of the per-seed differences predictive − ratio
    low: float
    high: float
    seeds: int
    p: float  # two-sided paired t-test
    p_holm: float = math.nan


def _secondary_of(result: AnalysisResult) -> list[Secondary]:
    from pdmctl.report.stats import paired_difference, paired_p_value

    label = label_of(result)
    found = []

    def add(protocol: str, estimator: str, measure: str, diffs: list[float]) -> None:
        estimate = paired_difference(diffs, [0.0] * len(diffs)) if diffs else None
        interval = estimate.interval if estimate is not None else None
        found.append(Secondary(
            label, protocol, estimator, measure, estimate.mean if estimate is not None else math.nan,
            interval.low if interval is not None else math.nan, interval.high if interval is not None else math.nan,
            len(diffs), paired_p_value(diffs),
        ))  # fmt: skip

    for protocol, comparisons in result.protocol_comparisons.items():
        for c in comparisons:
            if (protocol, c.estimator) == (PRIMARY_PROTOCOL, PRIMARY_ESTIMATOR) or protocol in NOT_EVIDENCE:
                continue  # the primary metric: tested on its own; own-grad: not evidence
            add(protocol, c.estimator, "unsafe-keep",
                _per_seed(c.predictive.unsafe_keep_per_seed, c.ratio.unsafe_keep_per_seed))  # fmt: skip
    if result.counterfactual:
        for estimator in ("agg", "uni", "exact"):
            # a criterion's masked disagreement tokens are the other's kept ones: their needless-mask rates
            # mirror the unsafe-keep rates, so the needless masks are compared on the out-of-region sample
            for measure, tokens, decision, field in (
                ("region unsafe-keep", "disagreement", "kept", "region_up"),
                ("needless mask (sample)", "out-of-region", "masked", "own_down"),
            ):
                pred = _counts(result, estimator, "predictive", tokens, decision)
                ratio = _counts(result, estimator, "ratio", tokens, decision)
                if pred is None or ratio is None:
                    continue
                add(PRIMARY_PROTOCOL, estimator, measure,
                    _per_seed(_rates(getattr(pred, field), pred.n), _rates(getattr(ratio, field), ratio.n)))  # fmt: skip
    return found


def secondary_family(results: list[AnalysisResult]) -> list[Secondary]:
    """Every secondary comparison of every analysis given, with Holm's p over all of them together."""
    import dataclasses

    from pdmctl.report.stats import holm

    family = [s for r in results for s in _secondary_of(r)]
    adjusted = holm([s.p for s in family])
    return [dataclasses.replace(s, p_holm=p) for s, p in zip(family, adjusted, strict=True)]


def _pts(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{100 * x:+.1f}"


def _interval(low: float, high: float) -> str:
    return "n/a" if not (math.isfinite(low) and math.isfinite(high)) else f"[{_pts(low)}, {_pts(high)}]"


def primary_lines(metric: PrimaryMetric) -> list[str]:
    """The primary metric in a few lines (what `pdmctl analyze` prints and the results doc quotes)."""
    if not math.isfinite(metric.pooled):
        return [f"PRIMARY METRIC {metric.label}: not measured (the counterfactual protocol was not run, or a "
                "criterion kept no disagreement token)"]  # fmt: skip
    lines = [
        f"PRIMARY METRIC {metric.label} (named before the run): predictive − ratio unsafe-keep rate, counterfactual "
        f"protocol, {PRIMARY_ESTIMATOR} disagreement tokens",
        f"  pooled over tokens: {_pts(metric.pooled)} points, 95% seed-cluster bootstrap {_interval(metric.low, metric.high)} "
        f"({metric.kept_predictive} predictive-kept, {metric.kept_ratio} ratio-kept tokens, {metric.seeds} seeds)",
        f"  per-seed mean:      {_pts(metric.per_seed_mean)} points, 95% t-interval {_interval(metric.t_low, metric.t_high)} "
        f"({metric.seeds_compared} seeds with both rates)",
    ]  # fmt: skip
    if metric.warning:
        lines.append(metric.warning)
    return lines


SECONDARY_COLUMNS = ("analysis", "protocol", "estimator", "measure", "mean difference", "95% t-interval", "seeds",
                     "p", "p Holm")  # fmt: skip


def secondary_rows(family: list[Secondary]) -> list[tuple[str, ...]]:
    from pdmctl.report.stats import format_p

    return [(s.label, s.protocol, s.estimator, s.measure, _pts(s.mean), _interval(s.low, s.high), str(s.seeds),
             format_p(s.p), format_p(s.p_holm)) for s in family]  # fmt: skip


def render_secondary_table(family: list[Secondary]):
    from pdmctl.analysis.tables import _table

    labels = sorted({s.label for s in family})
    title = (f"Secondary comparisons, predictive − ratio (percentage points): mean of the per-seed differences, "
             f"paired t-test; Holm over all {sum(math.isfinite(s.p) for s in family)} tests of "
             f"{' + '.join(labels)} ({', '.join(NOT_EVIDENCE)}: not tested, its sign is the criterion's own "
             "prediction)")  # fmt: skip
    return _table(title, SECONDARY_COLUMNS, 4, secondary_rows(family))


def coverage(seeds: int, simulations: int, rng: np.random.Generator, *, resamples: int = 1000) -> tuple[float, float]:
    """How often the seed-cluster bootstrap interval and the per-seed t interval cover the truth, in a
    simulation shaped like the analysis: per seed a Poisson(40) number of kept disagreement tokens per
    criterion, each seed's unsafe rates drawn around 0.35 (predictive) and 0.55 (ratio) with a seed effect
    (logit scale, s.d. 0.8). The truth of each interval: the pooled difference and the per-seed mean
    difference of 200,000 seeds. Returns (bootstrap coverage, t coverage)."""
    from scipy import stats as sps

    def draw(n: int) -> tuple[np.ndarray, ...]:
        seed_effect = rng.normal(0, 0.8, size=n)
        n_p, n_r = rng.poisson(40, n), rng.poisson(40, n)
        p_p = 1 / (1 + np.exp(-(np.log(0.35 / 0.65) + seed_effect)))
        p_r = 1 / (1 + np.exp(-(np.log(0.55 / 0.45) + seed_effect + rng.normal(0, 0.5, n))))
        return rng.binomial(n_p, p_p), n_p, rng.binomial(n_r, p_r), n_r

    big = draw(200_000)
    truth_pooled = pooled_difference(*big)
    ok = (big[1] > 0) & (big[3] > 0)
    truth_seed = float(np.mean(big[0][ok] / big[1][ok] - big[2][ok] / big[3][ok]))
    hit_b = hit_t = 0
    for _ in range(simulations):
        up_p, n_p, up_r, n_r = draw(seeds)
        low, high = cluster_bootstrap(up_p, n_p, up_r, n_r, resamples=resamples, rng=rng)
        hit_b += low <= truth_pooled <= high
        ok = (n_p > 0) & (n_r > 0)
        d = up_p[ok] / n_p[ok] - up_r[ok] / n_r[ok]
        half = sps.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
        hit_t += abs(d.mean() - truth_seed) <= half
    return hit_b / simulations, hit_t / simulations
