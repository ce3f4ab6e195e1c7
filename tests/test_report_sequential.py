"""The report's interval when seeds were added after looking: it keeps 95% coverage where the plain t does not.

The design simulated is `pdmctl seeds` used as intended: 3 seeds, a look, 2 more where the comparison is not
resolved (its interval holds 0), a look, 3 more; normal per-seed differences (the t interval's own model).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from pdmctl.report.sequential import sequential_interval, simulate, stages

SIZES = (3, 5, 8)
SIMS = 40_000
SE = math.sqrt(0.95 * 0.05 / SIMS)  # Monte-Carlo standard error of a coverage near 95%


@pytest.mark.parametrize("effect", [0.0, 0.5, 1.0])
def test_sequential_interval_covers_95_percent_when_seeds_are_added_until_resolved(effect: float) -> None:
    sequential, plain = simulate(effect, SIZES, 0.95, SIMS, np.random.default_rng(20230 + int(10 * effect)))
    print(f"effect {effect}: sequential {sequential:.4f}, plain t {plain:.4f}")
    assert sequential >= 0.95 - 3 * SE
    assert plain < sequential


@pytest.mark.parametrize("effect", [0.0, 1.0])
def test_sequential_interval_covers_95_percent_with_seeds_added_one_at_a_time_from_three_to_five(effect: float) -> None:
    """The interval `report` and `seeds` both print for a sequentially extended comparison, at the seed counts a
    testbed sweep has (3, a look, 4, a look, 5): at least 95% (about 97%), where the plain t interval over the
    final seeds covers about 90% with no true difference."""
    sequential, plain = simulate(effect, (3, 4, 5), 0.95, SIMS, np.random.default_rng(30 + int(effect)))
    assert sequential >= 0.95 - 3 * SE
    if effect == 0.0:
        assert plain < 0.95 - 3 * SE


def test_plain_t_interval_undercovers_under_the_same_design() -> None:
    """The reason for the sequential interval: with no true difference, stopping at the first look whose
    plain 95% t interval leaves out 0 leaves the final interval covering about 88%."""
    _, plain = simulate(0.0, SIZES, 0.95, SIMS, np.random.default_rng(7))
    assert plain < 0.95 - 3 * SE


def test_one_stage_is_the_t_interval_at_half_the_error() -> None:
    d = [0.03, 0.07, -0.01, 0.05]
    interval, p, count = sequential_interval(d, [0, 0, 0, 0], 0.95)
    ref = sps.ttest_1samp(d, 0.0).confidence_interval(confidence_level=0.975)
    assert count == 1 and interval is not None
    assert (interval.low, interval.high) == pytest.approx((ref.low, ref.high))
    assert p == pytest.approx(min(1.0, 2 * sps.ttest_1samp(d, 0.0).pvalue))


def test_stages_follow_the_looks_in_order() -> None:
    assert stages([0, 0, 0, 2, 2, 5]) == [1, 1, 1, 2, 2, 3]
    assert stages([1, 0, 1]) == [2, 1, 2]


def test_interval_is_the_intersection_of_the_stages_intervals() -> None:
    d = [0.10, 0.02, 0.05, 0.30, 0.28]
    interval, _, count = sequential_interval(d, [0, 0, 0, 1, 1], 0.95)
    first = sps.ttest_1samp(d[:3], 0.0).confidence_interval(confidence_level=1 - 0.05 / 2)
    second = sps.ttest_1samp(d, 0.0).confidence_interval(confidence_level=1 - 0.05 / 4)
    assert count == 2 and interval is not None
    assert interval.low == pytest.approx(max(first.low, second.low))
    assert interval.high == pytest.approx(min(first.high, second.high))


def test_p_value_rejects_exactly_when_the_interval_leaves_out_zero() -> None:
    rng = np.random.default_rng(11)
    agreed = 0
    for _ in range(300):
        d = list(rng.normal(0.6, 1.0, 8))
        interval, p, _ = sequential_interval(d, [0, 0, 0, 1, 1, 2, 2, 2], 0.95)
        assert interval is not None
        excludes = interval.low > 0 or interval.high < 0
        assert excludes == (p < 0.05)
        agreed += excludes
    assert 0 < agreed < 300  # both outcomes occurred


def test_report_reads_a_sweep_with_added_seeds_sequentially_and_one_without_as_fixed(tmp_path) -> None:
    import sys
    from pathlib import Path

    from pdmctl.report.build import build_report
    from pdmctl.report.definition import load_definition
    from pdmctl.report.tables import comparison_table, methods

    sys.path.insert(0, str(Path(__file__).parent))
    from test_report_synthetic import finish, make_sweep, write_points

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    definition = load_definition("default")
    rng = np.random.default_rng(4)
    values = {(mask, seed): rng.uniform(0.2, 0.6, 2) for mask in ("pdm_agg", "dppo_topk_kl") for seed in range(5)}
    reports = {}
    for name, tagged in (("fixed", ()), ("added", (3, 4))):
        sweep = make_sweep(uri, name, ["mask=pdm_agg,dppo_topk_kl", "seed=0,1,2,3,4"])
        points = []
        for run_id, spec in sweep.specs.items():
            v = values[spec.config["mask"]["name"], spec.seed]
            points += [(run_id, "eval/toy24", 4, float(v[0])), (run_id, "eval/toy25", 4, float(v[1]))]
        write_points(sweep.ledger, points)
        finish(sweep.ledger, list(sweep.specs))
        marked = [dict(key="pdmctl.prov.look", value="1", run_uuid=run_id)
                  for run_id, spec in sweep.specs.items() if spec.seed in tagged]  # fmt: skip
        if marked:
            with sweep.ledger.engine.begin() as conn:
                conn.execute(sweep.ledger.t["tags"].insert(), marked)
        reports[name] = build_report(sweep.ledger, [name], definition)
    d = [float(values["pdm_agg", s][0] - values["dppo_topk_kl", s][0]) for s in range(5)]
    fixed = reports["fixed"].comparisons[0].cells["AIME24"].difference.interval
    plain = sps.ttest_1samp(d, 0.0).confidence_interval(confidence_level=0.95)
    assert not reports["fixed"].sequential
    assert (fixed.low, fixed.high) == pytest.approx((plain.low, plain.high))
    added = reports["added"]
    want, _, count = sequential_interval(d, [0, 0, 0, 1, 1], 0.95)
    got = added.comparisons[0].cells["AIME24"].difference.interval
    assert count == 2 and set(added.sequential.values()) == {2}
    assert (max(got.low, -1.0), min(got.high, 1.0)) == pytest.approx((max(want.low, -1.0), min(want.high, 1.0)))
    assert "group-sequential" in comparison_table(added).title
    assert any("Seeds added sequentially" in line for line in methods(added))
    assert not any("Seeds added sequentially" in line for line in methods(reports["fixed"]))
