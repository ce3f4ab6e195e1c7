"""`pdmctl analyze` on the testbed, one run for the file: its tables, JSON and figures, and the regime beside the
paper's §4.2, printed and written from the run's own tokens."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdmctl.analysis.regime import regime_of, regime_rows
from pdmctl.analysis.results import AnalysisResult
from tests.conftest import Result, pdmctl


@pytest.fixture(scope="module")
def analysis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Result]]:
    """`pdmctl analyze` of 2 seeds with every protocol, its JSON and its figures, in a folder of its own."""
    workdir = tmp_path_factory.mktemp("analyze")
    res = pdmctl("analyze", "--seeds", "2", "backend.prompts_per_step=32", "--json", "analysis.json", "--figures",
                 "figs", "--jobs", "2", cwd=workdir)  # fmt: skip
    yield workdir, res


def _independent(data: dict) -> dict:
    """The regime counted again from the run's token records: the per-position token counts and every `exact`
    disagreement token with its seed, its decision and its ΔD after the carried update."""
    seeds = len(data["seeds"])
    tokens, out = sum(data["tokens_per_position"]), sum(data["out_of_region_per_position"])
    (records,) = [t for t in data["disagreement_tokens"] if t["estimator"] == "exact"]
    per_seed = [records["seed"].count(i) for i in range(seeds)]
    rates, pooled = {}, {}
    for criterion, keeps in (("predictive", True), ("ratio", False)):
        kept = [[d > 0 for s, k, d in zip(records["seed"], records["predictive_keeps"], records["delta_d"]["carried"],
                                            strict=True) if s == i and k == keeps] for i in range(seeds)]  # fmt: skip
        rates[criterion] = statistics.mean(sum(k) / len(k) for k in kept if k)
        pooled[criterion] = sum(map(sum, kept)) / sum(map(len, kept))
    return {"tokens": tokens, "out": out, "per_seed": per_seed, "rates": rates, "pooled": pooled}


def test_analyze_prints_and_writes_the_regime_from_its_own_tokens(analysis: tuple[Path, Result]) -> None:
    workdir, res = analysis
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((workdir / "analysis.json").read_text())
    regime, count = data["regime"], _independent(data)
    assert regime["response_tokens"] == count["tokens"] and regime["out_of_region"] == count["out"] > 0
    assert abs(regime["out_of_region_share"] - count["out"] / count["tokens"]) < 1e-12
    assert regime["estimator"] == "exact" and regime["disagreements"] == sum(count["per_seed"]) > 0
    assert abs(regime["disagreement_share"] - sum(count["per_seed"]) / count["out"]) < 1e-12
    assert regime["disagreements_median_per_seed"] == statistics.median(count["per_seed"])
    assert regime["realized_protocol"] == "carried"
    for criterion in ("predictive", "ratio"):
        assert abs(regime[f"unsafe_keep_{criterion}"] - count["rates"][criterion]) < 1e-6
        assert abs(regime[f"unsafe_keep_{criterion}_pooled"] - count["pooled"][criterion]) < 1e-12
    assert (regime["paper_out_of_region_per_seed"], regime["paper_disagreements_per_seed"]) == (1435, 82)
    # the printed lines: each measure with this run's value and the paper's beside it
    out = " ".join(res.stdout.split())
    assert "The regime beside the paper's (§4.2)" in out
    share = f"{100 * count['out'] / count['tokens']:.1f}%"
    assert f"out of the region, of the response tokens │ {share}" in out and "1,435 per seed" in out
    disagreement = f"{100 * sum(count['per_seed']) / count['out']:.2f}%"
    assert f"disagreement tokens (exact), of the out-of-region │ {disagreement}" in out
    assert f"median {statistics.median(count['per_seed']):g})" in out and "5.7% (82 of 1,435 per seed)" in out
    rates = f"{100 * count['rates']['predictive']:.1f}% / {100 * count['rates']['ratio']:.1f}%"
    assert f"mean over seeds: predictive / ratio │ {rates}" in out and "34.2% / 36.9%" in out
    # read back, and without the carried protocol the realized rate is not measured, not made up
    result = AnalysisResult.from_dict(data)
    assert dataclasses.asdict(result.regime) == regime
    without = regime_of(dataclasses.replace(result, protocol_comparisons={
        p: c for p, c in result.protocol_comparisons.items() if p != "carried"}))  # fmt: skip
    assert without.realized_protocol is None and without.unsafe_keep_predictive is None
    assert "not measured" in regime_rows(without, 3)[-1][1]


def test_analyze_prints_table_and_json(analysis: tuple[Path, Result]) -> None:
    workdir, res = analysis
    assert res.returncode == 0, res.stdout + res.stderr
    assert "unsafe" in res.stdout.lower()
    assert "counterfactual (main)" in res.stdout and "fresh-adam" in res.stdout  # the protocols, side by side
    data = json.loads((workdir / "analysis.json").read_text())
    assert data["protocol"] == "counterfactual" and list(data["protocol_comparisons"]) == [
        "counterfactual", "carried", "fresh-adam", "sgd", "own-adam", "own-grad"]  # fmt: skip
    assert data["model"] == "toy-small" and len(data["counterfactual"]) == 24  # 3 estimators × 2 × 2 × 2
    # the primary metric, named before the run, with both intervals; the Holm family
    assert "PRIMARY METRIC toy-small" in res.stdout and "seed-cluster bootstrap" in res.stdout
    assert "95% t-interval" in res.stdout and "p Holm" in res.stdout
    assert data["decomposition"] and data["logit_assumption"]  # the decomposition, in the JSON too
    assert "ΔD decomposed" in res.stdout and "e_k − π" in res.stdout
    assert data["setting"] == "stale" and len(data["disagreement_tokens"]) == 3  # the figures' data
    assert sorted(p.name for p in (workdir / "figs").iterdir()) == [
        "delta_d_cdf.png", "disagreements.png", "positions.png", "seed_pairs.png"]  # fmt: skip
