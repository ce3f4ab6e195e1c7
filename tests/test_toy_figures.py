"""The paper's figures (figures.py) are written and drawn from the analysis's own numbers."""

from __future__ import annotations

import json

import pytest

from pdmctl.analysis.figures import FIGURES, delta_d_cdf, main, position_stats, seed_pairs, write_figures
from pdmctl.analysis.results import ESTIMATORS
from pdmctl.analysis.run import run_analysis
from pdmctl.backends.toy import ToyConfig


@pytest.fixture(scope="module")
def result():
    return run_analysis(ToyConfig(prompts_per_step=16), [5, 6], ("carried", "own-grad"), threads=1)


def test_the_disagreement_tokens_are_the_tables_tokens(result) -> None:
    for c, tokens in zip(result.comparisons, result.disagreement_tokens, strict=True):
        assert tokens.estimator == c.estimator
        per_seed = [tokens.seed.count(i) for i in range(len(result.seeds))]
        assert per_seed == c.disagreement_per_seed  # every one has A ≠ 0: at A = 0 both criteria keep
        assert all(a != 0 for a in tokens.advantage)
        assert sum(tokens.predictive_keeps) == c.predictive.kept_pooled
        kept = [d for d, p in zip(tokens.delta_d["carried"], tokens.predictive_keeps, strict=True) if p]
        assert sum(d < 0 for d in kept) / len(kept) == pytest.approx(c.predictive.corrective_pooled)
    assert sum(result.tokens_per_position) == sum(result.tokens_per_seed)
    assert sum(result.out_of_region_per_position) == sum(result.out_of_region_per_seed)


def test_figures_are_written_and_plot_the_result(result, tmp_path) -> None:
    paths = write_figures(result, tmp_path / "figs")
    assert [p.name for p in paths] == [f"{name}.png" for name in FIGURES]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in paths)
    cdf = delta_d_cdf(result)  # each panel: the ratio's kept tokens' sorted ΔD, then the predictive's
    for ax, tokens in zip(cdf.axes, result.disagreement_tokens, strict=True):
        for line, predictive in zip(ax.lines[:2], (False, True), strict=True):
            kept = sorted(d for d, p in zip(tokens.delta_d["carried"], tokens.predictive_keeps, strict=True)
                          if p == predictive)  # fmt: skip
            assert list(line.get_xdata()) == kept
            assert list(line.get_ydata()) == pytest.approx([(i + 1) / len(kept) for i in range(len(kept))])
    pairs = seed_pairs(result)
    for ax, c in zip(pairs.axes, result.comparisons, strict=True):
        points = [tuple(p) for p in ax.collections[0].get_offsets()]
        assert points == [(r, p) for r, p in zip(c.ratio.unsafe_keep_per_seed, c.predictive.unsafe_keep_per_seed,
                                                 strict=True) if r is not None and p is not None]  # fmt: skip
    stats = position_stats(result)
    exact = result.disagreement_tokens[ESTIMATORS.index("exact")]
    assert sum(stats["disagreements"]) == len(exact.position)
    assert max(stats["disagreements"]) > 0


def test_figures_from_the_json(result, tmp_path) -> None:
    (tmp_path / "a.json").write_text(result.to_json())
    main([str(tmp_path / "a.json"), str(tmp_path / "out")])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{n}.png" for n in FIGURES)
    old = json.loads(result.to_json())
    del old["disagreement_tokens"]  # an analysis written before the figures' data: one line
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="no disagreement_tokens"):
        main([str(tmp_path / "old.json"), str(tmp_path / "out2")])


def test_the_report_draws_the_analysis_figures(result) -> None:
    """`pdmctl report --analysis out.json` adds the four figures to the report's (an older analysis: none)."""
    from types import SimpleNamespace

    from pdmctl.report.definition import load_definition
    from pdmctl.report.write import figures

    report = SimpleNamespace(definition=load_definition("default"), curves=[], analysis=json.loads(result.to_json()))
    found = figures(report)
    assert [f.name for f in found] == [f"direction_{name}.png" for name in FIGURES]
    assert all(f.png[:4] == b"\x89PNG" and "Direction analysis" in f.caption for f in found)
    del report.analysis["disagreement_tokens"]
    assert figures(report) == []
