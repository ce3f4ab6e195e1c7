"""The token-level direction analysis runs end to end and reports what MATH.md asks for."""

from __future__ import annotations

import json

import torch
from rich.console import Console

from pdmctl.backends.toy import ToyConfig
from pdmctl.backends.toy.analysis import (
    ESTIMATORS,
    analysis_rows,
    render_analysis_table,
    render_difference_table,
    run_analysis,
)


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
    # the paired differences between estimators: per seed, the predictive criterion's rates
    pairs = [(d.measure, d.first, d.second) for d in result.estimator_differences]
    assert pairs == [(m, a, b) for m in ("unsafe-keep", "corrective")
                     for a, b in (("uni", "agg"), ("exact", "agg"), ("exact", "uni"))]  # fmt: skip
    by_estimator = {c.estimator: c.predictive for c in result.comparisons}
    for d in result.estimator_differences:
        field = "unsafe_keep_per_seed" if d.measure == "unsafe-keep" else "corrective_per_seed"
        diffs = [a - b for a, b in zip(getattr(by_estimator[d.first], field), getattr(by_estimator[d.second], field),
                                      strict=True) if a is not None and b is not None]  # fmt: skip
        assert d.seeds == len(diffs) == 2
        assert abs(d.mean - sum(diffs) / 2) < 1e-12 and d.low <= d.mean <= d.high
    console = Console(width=200, record=True)
    console.print(render_analysis_table(result))
    console.print(render_difference_table(result))
    text = console.export_text()
    assert "unsafe-keep" in text and "exact − uni" in text and "95% t-interval" in text


def test_analysis_is_reproducible() -> None:
    cfg = ToyConfig(prompts_per_step=32)
    assert run_analysis(cfg, [3]).to_json() == run_analysis(cfg, [3]).to_json()


def test_every_criterion_starts_from_the_same_weights_and_optimizer_state(monkeypatch) -> None:
    """Issue 19 item 1: each criterion's update starts bit for bit from the stale learner's weights and Adam
    state (restoring the optimizer from the snapshot itself let Adam advance the snapshot: step 7, 8, 9, 10)."""
    from pdmctl.backends.toy.trainer import Learner

    starts: list[tuple[dict, dict]] = []
    update = Learner.update

    def recording_update(self, batch, advantages, cfg):
        weights = {k: v.clone() for k, v in self.policy.state_dict().items()}
        state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for i, s in self.optimizer.state_dict()["state"].items()}  # fmt: skip
        starts.append((weights, state))
        return update(self, batch, advantages, cfg)

    monkeypatch.setattr(Learner, "update", recording_update)
    cfg = ToyConfig(prompts_per_step=16)
    run_analysis(cfg, [5])
    criteria = starts[
        cfg.minibatches - 1 :
    ]  # after the stale mini-batch updates: dppo, then pdm per estimator
    assert len(criteria) == 1 + len(ESTIMATORS)
    first_weights, first_state = criteria[0]
    assert first_state and all(int(s["step"]) == cfg.minibatches - 1 for s in first_state.values())
    for weights, state in criteria[1:]:
        assert weights.keys() == first_weights.keys() and state.keys() == first_state.keys()
        assert all(torch.equal(weights[k], first_weights[k]) for k in weights)
        for i, s in state.items():
            assert s.keys() == first_state[i].keys()
            for k, v in s.items():
                assert (
                    torch.equal(v, first_state[i][k])
                    if isinstance(v, torch.Tensor)
                    else v == first_state[i][k]
                )
