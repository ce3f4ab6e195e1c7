"""The token-level direction analysis runs end to end and reports what MATH.md asks for."""

from __future__ import annotations

import json

from rich.console import Console

from pdmctl.backends.toy import ToyConfig
from pdmctl.backends.toy.analysis import ESTIMATORS, analysis_rows, render_analysis_table, run_analysis


def test_analysis_reports_each_estimator_against_the_ratio_criterion() -> None:
    result = run_analysis(ToyConfig(prompts_per_step=64), seeds=[7, 8])
    assert result.seeds == [7, 8]
    assert all(
        0 < out < tokens
        for out, tokens in zip(result.out_of_region_per_seed, result.tokens_per_seed, strict=True)
    )
    assert [c.estimator for c in result.comparisons] == list(ESTIMATORS)
    for c in result.comparisons:
        assert len(c.disagreement_per_seed) == 2 and sum(c.disagreement_per_seed) > 0
        assert sum(c.disagreement_per_seed) == c.ratio.kept_pooled + c.predictive.kept_pooled
        assert c.predictive_wins + c.ratio_wins <= c.seeds_compared <= 2
    assert json.loads(result.to_json())["comparisons"][0]["estimator"] == "agg"
    rows = analysis_rows(result)
    assert len(rows) == 2 * len(ESTIMATORS)
    console = Console(width=200, record=True)
    console.print(render_analysis_table(result))
    assert "unsafe-keep" in console.export_text()


def test_analysis_is_reproducible() -> None:
    cfg = ToyConfig(prompts_per_step=32)
    assert run_analysis(cfg, [3]).to_json() == run_analysis(cfg, [3]).to_json()
