"""The direction analysis's inference: the primary metric, named before the run, with its
two intervals, and every secondary comparison with its Holm-adjusted p over one family.

The primary metric (docs/results/analysis.md, "The primary metric"): under the `counterfactual`
protocol, on the disagreement tokens of the `exact` estimator, the predictive criterion's unsafe-keep
rate minus the ratio criterion's, each pooled over the tokens it keeps (all seeds together: Σ unsafe /
Σ kept); its 95% interval from a seed-cluster bootstrap (seeds resampled with replacement, the pooled
difference recomputed, the 2.5 and 97.5 percentiles; 10,000 resamples, generator seeded 27), its two-sided
sign-flip p (the two criteria's counts swapped within each seed at random, the same generator) and Kish's
effective number of seeds from the per-seed kept-token counts, with a warning below FEW_EFFECTIVE_SEEDS. The
same statistic, interval, p and effective seeds from each of three channels (`CHANNELS`). Beside it,
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdmctl.analysis.results import AnalysisResult

PRIMARY_PROTOCOL, PRIMARY_ESTIMATOR = "counterfactual", "exact"
# not evidence: own-grad's ΔD is the criterion's own first-order prediction pushed through the
# network, so its sign is sign(A·Ḋ) by construction; printed beside the others, never tested
NOT_EVIDENCE = ("own-grad",)
RESAMPLES, BOOTSTRAP_SEED, LEVEL = 10_000, 27, 0.95
# below this many effective seeds (Kish, from the per-seed token counts) a pooled interval rests on a handful of
# seeds: printed with a warning
FEW_EFFECTIVE_SEEDS = 10


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


def effective_seeds(counts) -> float:
    """Kish's effective number of seeds of a statistic pooled over tokens, (Σ n)² / Σ n², from each seed's
    token count: the seed count when every seed holds as many tokens, fewer as a few seeds hold most (NaN: no
    token)."""
    n = np.asarray(counts, dtype=float)
    square = float(np.sum(n * n))
    return float(np.sum(n)) ** 2 / square if square > 0 else math.nan


def sign_flip_p(up_a, n_a, up_b, n_b, *, resamples: int = RESAMPLES, rng: np.random.Generator | None = None) -> float:
    """Two-sided p of `pooled_difference` against no difference between the two sides: under the null the two
    sides' (unsafe, kept) counts are exchangeable within a seed, so each seed's pair is swapped with
    probability 1/2 and the pooled difference recomputed; p = (1 + #{|d*| ≥ |d|}) / (1 + resamples)
    (resamples where a side has no token count as not extreme). NaN where the statistic is not defined."""
    ua, na, ub, nb = (np.asarray(x, dtype=float) for x in (up_a, n_a, up_b, n_b))
    observed = pooled_difference(ua, na, ub, nb)
    if not math.isfinite(observed):
        return math.nan
    rng = rng if rng is not None else np.random.default_rng(BOOTSTRAP_SEED)
    swap = rng.integers(0, 2, size=(resamples, len(ua))).astype(bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = (np.where(swap, ub, ua).sum(1) / np.where(swap, nb, na).sum(1)
                 - np.where(swap, ua, ub).sum(1) / np.where(swap, na, nb).sum(1))  # fmt: skip
    extreme = np.abs(stats) >= abs(observed) - 1e-12  # ties by float rounding of the same sums count
    return float((1 + np.sum(extreme & np.isfinite(stats))) / (1 + resamples))


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
    p: float = math.nan  # the pooled difference's two-sided sign-flip p over seeds (sign_flip_p)
    effective_seeds: float = math.nan  # Kish's, from the per-seed kept disagreement tokens of both criteria

    @property
    def few_seeds_warning(self) -> str | None:
        if math.isfinite(self.effective_seeds) and self.effective_seeds < FEW_EFFECTIVE_SEEDS:
            return (f"WARNING {self.label}: {self.effective_seeds:.1f} effective seeds (of {self.seeds}): a few seeds "
                    "hold most of the tokens, and the pooled interval rests on them")  # fmt: skip
        return None

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
    p = sign_flip_p(pred.own_up, pred.n, ratio.own_up, ratio.n, resamples=resamples)
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
        p=p,
        effective_seeds=effective_seeds([a + b for a, b in zip(pred.n, ratio.n, strict=True)]),
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
        f"({metric.kept_predictive} predictive-kept, {metric.kept_ratio} ratio-kept tokens, {metric.seeds} seeds, "
        f"{metric.effective_seeds:.1f} effective), sign-flip p over seeds {_p(metric.p)}",
        f"  per-seed mean:      {_pts(metric.per_seed_mean)} points, 95% t-interval {_interval(metric.t_low, metric.t_high)} "
        f"({metric.seeds_compared} seeds with both rates)",
    ]  # fmt: skip
    for warning in (metric.warning, metric.few_seeds_warning):
        if warning:
            lines.append(warning)
    return lines


def primary_test_lines(metrics: Sequence[PrimaryMetric], alpha: float = 0.05) -> list[str]:
    """The one primary test over several runs (the presets of one `analyze --family`): each run's primary
    statistic with its sign-flip p, Holm-adjusted over the runs, so that "the predictive criterion is safer
    on at least one of them" keeps its family-wise error at `alpha`. Nothing for a single run."""
    from pdmctl.report.stats import holm

    if len(metrics) < 2:
        return []
    adjusted = holm([m.p if math.isfinite(m.pooled) else math.nan for m in metrics])
    lines = [f"PRIMARY TEST over {len(metrics)} runs: the primary statistic's sign-flip p, Holm-adjusted over the "
             f"runs (family-wise {100 * alpha:.0f}%)"]  # fmt: skip
    for metric, p_holm in zip(metrics, adjusted, strict=True):
        verdict = "not measured" if not math.isfinite(p_holm) else (
            ("predictive safer" if metric.pooled < 0 else "ratio safer") if p_holm <= alpha else "no difference shown")
        lines.append(f"  {metric.label}: {_pts(metric.pooled)} points, p {_p(metric.p)}, Holm {_p(p_holm)} "
                     f"({verdict})")  # fmt: skip
    return lines


def _p(p: float) -> str:
    from pdmctl.report.stats import format_p

    return format_p(p) if math.isfinite(p) else "n/a"


# the primary metric's channels: the same statistic on the same tokens from three measurements of a token's
# effect, each with the question it answers
CHANNELS = (
    ("whole step", "counterfactual",
     "what the decision does in one real update: the whole batch after the step's first mini-batch updates, "
     "the carried Adam state, the clip factor as each member's own gradient norm sets it (the primary metric)"),
    ("clip held", "counterfactual (clip held)",
     "the same update with both members' gradients scaled by the criterion's own update's clip factor: the "
     "decision's effect without the change it makes to the global clip"),
    ("own step, first order", "own-adam",
     "the token's own gradient alone through the carried Adam step's gain, first order at the start weights: "
     "what its own step does, without the rest of the update moving the weights first"),
)  # fmt: skip


@dataclass(frozen=True)
class Channel:
    name: str
    source: str  # where its counts come from (a protocol, or the counterfactual with the clip held)
    question: str
    pooled: float  # predictive − ratio unsafe-keep rate, tokens pooled (NaN: not measured)
    low: float  # seed-cluster bootstrap interval
    high: float
    p: float  # sign-flip p over seeds
    effective_seeds: float  # Kish's


def _channel_counts(result: AnalysisResult, source: str):
    """(unsafe predictive, kept predictive, unsafe ratio, kept ratio) per seed on the primary tokens, or None."""
    if source.startswith("counterfactual"):
        pred = _counts(result, PRIMARY_ESTIMATOR, "predictive", "disagreement", "kept")
        ratio = _counts(result, PRIMARY_ESTIMATOR, "ratio", "disagreement", "kept")
        field = "own_up_clip_held" if source.endswith("(clip held)") else "own_up"
        if pred is None or ratio is None or not getattr(pred, field):
            return None
        return getattr(pred, field), pred.n, getattr(ratio, field), ratio.n
    found = [c for c in result.protocol_comparisons.get(source, []) if c.estimator == PRIMARY_ESTIMATOR]
    if not found or not found[0].predictive.kept_per_seed:
        return None
    c = found[0]

    def ups(stats) -> list[int]:
        return [round(r * n) if r is not None else 0 for r, n in zip(stats.unsafe_keep_per_seed, stats.kept_per_seed,
                                                                       strict=True)]  # fmt: skip

    return ups(c.predictive), c.predictive.kept_per_seed, ups(c.ratio), c.ratio.kept_per_seed


def channels(result: AnalysisResult, *, resamples: int = RESAMPLES) -> list[Channel]:
    """The primary statistic from each channel's measurement (CHANNELS), where it was measured."""
    found = []
    for name, source, question in CHANNELS:
        counts = _channel_counts(result, source)
        if counts is None:
            continue
        low, high = cluster_bootstrap(*counts, resamples=resamples)
        found.append(Channel(name, source, question, pooled_difference(*counts), low, high,
                             sign_flip_p(*counts, resamples=resamples),
                             effective_seeds([a + b for a, b in zip(counts[1], counts[3], strict=True)])))  # fmt: skip
    return found


def channel_lines(result: AnalysisResult, *, resamples: int = RESAMPLES) -> list[str]:
    """The channels in a few lines (`pdmctl analyze` prints them after the primary metric)."""
    rows = channels(result, resamples=resamples)
    if not rows:
        return []
    lines = [f"CHANNELS {label_of(result)}: the primary statistic (predictive − ratio unsafe-keep rate, "
             f"{PRIMARY_ESTIMATOR} disagreement tokens, pooled) from three measurements of a token's effect"]  # fmt: skip
    for c in rows:
        lines.append(f"  {c.name + ':':23s}{_pts(c.pooled)} points, 95% seed-cluster bootstrap {_interval(c.low, c.high)}, "
                     f"sign-flip p {_p(c.p)}, {c.effective_seeds:.1f} effective seeds")  # fmt: skip
        lines.append(f"  {'':23s}({c.question})")
    floor = floor_line(result)
    return lines + ([floor] if floor else [])


def floor_line(result: AnalysisResult) -> str | None:
    """How many disagreement tokens' own effects are below the float32 sign floor, per criterion and estimator
    (float32 rounding can reach their size, so their signs, and so their unsafe or corrective labels, are not
    guaranteed; a float64 rerun keeps nearly all of them, bench/sign_floor.py); None where not counted."""
    from pdmctl.analysis.counterfactual import SIGN_FLOOR

    parts = []
    for estimator in ("agg", "uni", "exact"):
        for criterion in ("ratio", "predictive"):
            rows = [c for c in result.counterfactual if (c.estimator, c.criterion, c.tokens) ==
                    (estimator, criterion, "disagreement") and c.below_floor]  # fmt: skip
            if rows:
                below, n = sum(sum(c.below_floor) for c in rows), sum(sum(c.n) for c in rows)
                parts.append(f"{criterion}/{estimator} {below:,} of {n:,}")
    if not parts:
        return None
    return (f"own effects below the float32 sign floor (|own| < {SIGN_FLOOR:g}, within float32 rounding's reach), "
            f"disagreement tokens: {', '.join(parts)}")


def region_check_line(result: AnalysisResult) -> str | None:
    """How far the counterfactual's first-order region effects are from their exact values, on the variants
    where both were taken (None: none was, e.g. every one was taken exactly)."""
    if not result.region_check:
        return None
    pairs = np.asarray(result.region_check, dtype=float)
    first, exact = pairs[:, 0], pairs[:, 1]
    signs = int(((first > 0) == (exact > 0)).sum())
    return (f"region effect (secondary measure) by first order, against the full-batch value on {len(pairs)} "
            f"variants: max |error| {np.abs(first - exact).max():.2e} (largest |effect| {np.abs(exact).max():.2e}), "
            f"signs agree on {signs}/{len(pairs)}; --exact-region takes every variant's exactly")  # fmt: skip


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


def coverage(seeds: int, simulations: int, rng: np.random.Generator, *, resamples: int = 1000,
             counts: np.ndarray | None = None, rates: tuple[float, float] = (0.35, 0.55)) -> tuple[float, float]:  # fmt: skip
    """How often the seed-cluster bootstrap interval and the per-seed t interval cover the truth, in a
    simulation shaped like the analysis: per seed a number of kept disagreement tokens per criterion
    (Poisson(40) each, or, with `counts`, a seed's (predictive, ratio) pair drawn from a preset's real
    per-seed counts, an array [seeds, 2]: its skew and its seeds with none), each seed's unsafe rates drawn
    around `rates` (predictive, ratio; equal rates: no difference) with a seed effect (logit scale, s.d. 0.8).
    The truth of each interval: the pooled difference and the per-seed mean difference of 200,000 seeds.
    Returns (bootstrap coverage, t coverage)."""
    from scipy import stats as sps

    shape = None if counts is None else np.asarray(counts, dtype=int).reshape(-1, 2)

    def draw(n: int) -> tuple[np.ndarray, ...]:
        seed_effect = rng.normal(0, 0.8, size=n)
        if shape is None:
            n_p, n_r = rng.poisson(40, n), rng.poisson(40, n)
        else:
            n_p, n_r = shape[rng.integers(0, len(shape), size=n)].T
        p_p = 1 / (1 + np.exp(-(np.log(rates[0] / (1 - rates[0])) + seed_effect)))
        p_r = 1 / (1 + np.exp(-(np.log(rates[1] / (1 - rates[1])) + seed_effect + rng.normal(0, 0.5, n))))
        return rng.binomial(n_p, p_p), n_p, rng.binomial(n_r, p_r), n_r

    big = draw(200_000)
    truth_pooled = pooled_difference(*big)
    ok = (big[1] > 0) & (big[3] > 0)
    truth_seed = float(np.mean(big[0][ok] / big[1][ok] - big[2][ok] / big[3][ok]))
    hit_b = hit_t = 0
    for _ in range(simulations):
        up_p, n_p, up_r, n_r = draw(seeds)
        low, high = cluster_bootstrap(up_p, n_p, up_r, n_r, resamples=resamples, rng=rng)
        hit_b += low <= truth_pooled <= high  # an interval that cannot be computed (NaN) misses
        ok = (n_p > 0) & (n_r > 0)
        d = up_p[ok] / n_p[ok] - up_r[ok] / n_r[ok]
        if d.size >= 2:  # fewer than two seeds with tokens on both sides: no interval, a miss
            half = sps.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
            hit_t += abs(d.mean() - truth_seed) <= half
    return hit_b / simulations, hit_t / simulations


def real_counts(seeds_csv: str | Path, protocol: str = PRIMARY_PROTOCOL, estimator: str = PRIMARY_ESTIMATOR) -> np.ndarray:
    """A preset's per-seed kept disagreement tokens (predictive, ratio), [seeds, 2], from an analysis's seed
    table (`pdmctl analyze --csv`): the count shape `coverage` can draw seeds from."""
    import csv

    with open(seeds_csv, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["protocol"] == protocol and r["estimator"] == estimator]
    if not rows:
        raise ValueError(f"{seeds_csv}: no rows of protocol {protocol!r} and estimator {estimator!r}")
    return np.array([[int(r["predictive_kept"] or 0), int(r["ratio_kept"] or 0)] for r in rows], dtype=int)
