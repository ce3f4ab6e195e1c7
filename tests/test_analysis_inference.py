"""The direction analysis's inference: the primary metric's two intervals, Holm over the
family of both presets, and the bootstrap interval's coverage."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from pdmctl.analysis.inference import (
    PrimaryMetric,
    cluster_bootstrap,
    coverage,
    pooled_difference,
    primary_lines,
    primary_test_lines,
    real_counts,
    render_secondary_table,
    secondary_family,
)
from pdmctl.analysis.results import AnalysisResult, CounterfactualCounts


def test_pooled_difference_and_its_seed_cluster_bootstrap() -> None:
    up_a, n_a, up_b, n_b = [1, 2, 9], [10, 10, 30], [5, 5, 10], [10, 10, 20]
    assert pooled_difference(up_a, n_a, up_b, n_b) == 12 / 50 - 20 / 40
    low, high = cluster_bootstrap(up_a, n_a, up_b, n_b, resamples=2000, rng=np.random.default_rng(0))
    assert low <= pooled_difference(up_a, n_a, up_b, n_b) <= high < 0
    # seeds are resampled whole: with every seed alike the interval is one point
    low, high = cluster_bootstrap([1, 1], [4, 4], [2, 2], [4, 4], resamples=100, rng=np.random.default_rng(0))
    assert low == high == -0.25
    assert all(math.isnan(x) for x in cluster_bootstrap([1], [2], [1], [2]))


def test_sign_warning() -> None:
    metric = PrimaryMetric("toy-small", -0.02, -0.05, 0.01, 100, 80, 0.03, -0.01, 0.07, 4, 4)
    lines = primary_lines(metric)
    assert lines[1].strip().startswith("pooled over tokens: -2.0 points, 95% seed-cluster bootstrap [-5.0, +1.0]")
    assert "per-seed mean:      +3.0 points, 95% t-interval [-1.0, +7.0]" in lines[2]
    assert lines[-1].startswith("WARNING toy-small") and metric.warning is not None
    assert dataclasses.replace(metric, per_seed_mean=-0.01).warning is None


def _result(model: str, seeds: int, rng: np.random.Generator) -> AnalysisResult:
    rows = []
    for e in ("agg", "uni", "exact"):
        for criterion in ("ratio", "predictive"):
            for tokens in ("disagreement", "out-of-region"):
                for decision in ("kept", "masked"):
                    n = rng.integers(1, 30, seeds).tolist()
                    up = [int(rng.integers(0, k + 1)) for k in n]
                    rows.append(CounterfactualCounts(e, criterion, tokens, decision, n, up,
                                                     [k - u for k, u in zip(n, up, strict=True)], up, [0] * seeds))  # fmt: skip
    return AnalysisResult(seeds=list(range(seeds)), delta=0.15, k=20, divergence="topk_kl", precision="bf16",
                          tokens_per_seed=[100] * seeds, out_of_region_per_seed=[10] * seeds, comparisons=[],
                          estimator_differences=[], counterfactual=rows, model=model)  # fmt: skip


def test_holm_runs_over_both_presets_together() -> None:
    from pdmctl.report.stats import holm

    rng = np.random.default_rng(1)
    small, llm = _result("toy-small", 6, rng), _result("toy-llm", 6, rng)
    alone = secondary_family([small])
    both = secondary_family([small, llm])
    assert len(both) == 2 * len(alone) == 2 * 6  # region unsafe-keep and needless mask, 3 estimators each
    assert {s.measure for s in both} == {"region unsafe-keep", "needless mask (sample)"}
    assert {s.label for s in both} == {"toy-small", "toy-llm"}
    assert [s.p_holm for s in both] == holm([s.p for s in both])
    assert all(b.p_holm >= a.p_holm for a, b in zip(alone, both[: len(alone)], strict=True))


def test_the_primary_test_holm_adjusts_each_runs_p_over_the_runs() -> None:
    """Over several runs the primary statistic is one test: each run's sign-flip p Holm-adjusted over them, the
    verdict by the adjusted p; a run whose statistic was not measured is no test; one run alone has none."""
    from pdmctl.report.stats import holm

    def run(label: str, pooled: float, p: float) -> PrimaryMetric:
        return PrimaryMetric(label, pooled, pooled - 0.05, pooled + 0.05, 100, 100, pooled, -1, 1, 61, 61, p=p)

    runs = [run("toy-small", -0.235, 0.0001), run("toy-llm", -0.257, 0.034), run("toy-fork", 0.0, 0.989)]
    lines = primary_test_lines(runs)
    assert lines[0].startswith("PRIMARY TEST over 3 runs") and len(lines) == 4
    adjusted = holm([0.0001, 0.034, 0.989])
    assert adjusted[1] > 0.05  # toy-llm alone would pass; with the three, its adjusted p is 0.068
    assert lines[1].endswith("(predictive safer)") and "Holm 0.0003" in lines[1], lines[1]
    assert lines[2].endswith("(no difference shown)") and "Holm 0.068" in lines[2], lines[2]
    assert lines[3].endswith("(no difference shown)"), lines[3]
    assert primary_test_lines(runs[:1]) == []
    unmeasured = dataclasses.replace(runs[2], pooled=math.nan)
    lines = primary_test_lines([runs[0], runs[1], unmeasured])
    # two tests, not three: toy-llm's adjusted p is 0.034 then
    assert "Holm 0.034" in lines[2] and lines[2].endswith("(predictive safer)") and lines[3].endswith("(not measured)")


def test_own_grad_is_printed_but_never_tested() -> None:
    """Own-grad's sign is the criterion's own prediction (48 of 48 tokens), not evidence; it stays
    out of the Holm family, which the other protocols' unsafe-keep comparisons join."""
    from pdmctl.analysis.results import Comparison, CriterionStats

    rng = np.random.default_rng(2)
    base = _result("toy-small", 6, rng)
    rates = [0.2, 0.4, 0.3, 0.5, 0.6, 0.1]
    stats = CriterionStats(rates, 0.35, 0.08, 0.5, 60, rates, [10] * 6)
    lower = dataclasses.replace(stats, unsafe_keep_per_seed=[r / 2 for r in rates])
    comparison = Comparison("exact", [10] * 6, stats, lower, 6, 0, 6)
    result = dataclasses.replace(base, protocol_comparisons={"carried": [comparison], "own-grad": [comparison]})
    family = secondary_family([result])
    assert {(s.protocol, s.measure) for s in family} == {
        ("carried", "unsafe-keep"), ("counterfactual", "region unsafe-keep"), ("counterfactual", "needless mask (sample)")}
    assert len(family) == 1 + 6
    assert "own-grad: not tested" in render_secondary_table(family).title


def test_bootstrap_coverage_at_few_and_many_seeds() -> None:
    """The simulation of inference.coverage (seeds shaped like the analysis's, a seed effect on the logit
    scale), 300 runs each: the seed-cluster bootstrap undercovers at 4 seeds (the docs: 78% at 1,000 runs)
    and is near its 95% at 20 (93%); the per-seed t interval covers at both."""
    boot4, t4 = coverage(4, 300, np.random.default_rng(4), resamples=1000)
    boot20, t20 = coverage(20, 300, np.random.default_rng(20), resamples=1000)
    assert boot4 < 0.88 < boot20 and boot4 < boot20
    assert t4 > 0.9 and t20 > 0.9


def test_coverage_with_the_presets_real_token_counts() -> None:
    """The simulation drawn from toy-llm's own 61 seeds' kept tokens (a few seeds hold most of them, many
    hold none): at 5 seeds neither interval is near its 95% (a seed with no token on a side gives no t
    term, a bootstrap resample may hold none), at 61 both are within a few points of it, with a
    difference and without one. numpy's seeded generator: the same figures on any machine."""
    counts = real_counts(Path(__file__).resolve().parents[1] / "docs" / "results" / "analysis" / "toy-llm" / "seeds.csv")
    assert counts.shape == (61, 2) and (counts >= 0).all()
    boot5, t5 = coverage(5, 200, np.random.default_rng(5), resamples=500, counts=counts)
    assert boot5 < 0.85 and t5 < 0.85, (boot5, t5)
    for rates in ((0.35, 0.55), (0.45, 0.45)):
        boot61, t61 = coverage(61, 200, np.random.default_rng(61), resamples=500, counts=counts, rates=rates)
        assert boot61 > 0.88 and t61 > 0.88, (rates, boot61, t61)
