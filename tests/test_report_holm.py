"""Multiple comparisons in `pdmctl report`: p-values, Holm's adjustment per column, its
family-wise error rate under the null, and the tables that name it."""

from __future__ import annotations

import csv
import io
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from pdmctl.report.build import build_report
from pdmctl.report.definition import load_definition
from pdmctl.report.stats import holm, paired_p_value, welch_p_value
from pdmctl.report.tables import comparison_csv, comparison_table, to_html, to_latex, to_markdown

sys.path.insert(0, str(Path(__file__).parent))  # the synthetic-sweep helpers beside this file
from test_report_synthetic import finish, make_sweep, write_points


def test_holm_by_hand() -> None:
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005, math.nan])[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert math.isnan(holm([0.01, math.nan])[1]) and holm([0.01, math.nan])[0] == pytest.approx(0.01)
    assert holm([0.5, 0.9]) == [1.0, 1.0] and holm([]) == []
    # the stress table (docs/results/stress.md): 12 comparisons in the Average column; exact − GRPO passes, exact − DPPO does not
    family = [0.0036, 0.044, *np.linspace(0.1, 0.9, 10)]
    adjusted = holm(family)
    assert adjusted[0] == pytest.approx(12 * 0.0036) and adjusted[0] <= 0.05
    assert adjusted[1] == pytest.approx(11 * 0.044) and adjusted[1] > 0.05


def test_p_values_equal_scipy() -> None:
    rng = np.random.default_rng(3)
    for n in (2, 3, 5, 10):
        d = rng.normal(0.01, 0.02, n)
        assert paired_p_value(d) == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue, rel=1e-10)
        x, y = rng.normal(0.3, 0.02, n), rng.normal(0.28, 0.05, n + 1)
        assert welch_p_value(x, y) == pytest.approx(sps.ttest_ind(x, y, equal_var=False).pvalue, rel=1e-10)
    assert math.isnan(paired_p_value([0.1])) and math.isnan(welch_p_value([0.1, 0.2], [0.3]))
    assert paired_p_value([0.0, 0.0, 0.0]) == 1.0 and welch_p_value([0.2, 0.2], [0.1, 0.1]) == 0.0


SIMULATIONS = 4000


@pytest.mark.parametrize("seeds", [3, 4, 5])
def test_holm_holds_the_family_wise_error_rate_under_the_null(seeds: int) -> None:
    """12 masks against one baseline on `seeds` matched seeds, no mask better than the baseline: a seed effect
    every run of the seed shares, and run noise. Unadjusted, some p ≤ 0.05 in about half of such tables;
    with Holm, in at most 5% (+ 3 Monte-Carlo standard errors)."""
    rng = np.random.default_rng(seeds)
    masks, alpha = 12, 0.05
    seed_effect = rng.normal(0.35, 0.05, (SIMULATIONS, 1, seeds))
    runs = seed_effect + rng.normal(0, 0.02, (SIMULATIONS, masks + 1, seeds))
    d = runs[:, 1:] - runs[:, :1]  # each mask minus the baseline, per seed: the report's paired differences
    t = d.mean(-1) / (d.std(-1, ddof=1) / math.sqrt(seeds))
    p = 2 * sps.t.sf(np.abs(t), seeds - 1)
    for i in range(20):  # the vectorised p is the report's own
        assert p[i, 0] == pytest.approx(paired_p_value(d[i, 0]), rel=1e-9)
    adjusted = np.array([holm(row) for row in p.tolist()])
    margin = 3 * math.sqrt(alpha * (1 - alpha) / SIMULATIONS)
    fwer_raw = float((p <= alpha).any(-1).mean())
    fwer_holm = float((adjusted <= alpha).any(-1).mean())
    print(
        f"{seeds} seeds, {masks} comparisons, {SIMULATIONS} tables: FWER raw {fwer_raw:.3f}, Holm {fwer_holm:.3f}"
    )
    assert fwer_holm <= alpha + margin
    assert fwer_raw > alpha + 5 * margin
    assert float((p <= alpha).mean()) == pytest.approx(alpha, abs=margin)  # each test alone holds its level


def test_report_adjusts_each_column_and_names_the_family(tmp_path: Path) -> None:
    """Three masks against DPPO on four seeds: each column's p-values are the paired t-tests, adjusted by Holm
    over that column's three rows; every rendering says so under the table."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    masks = ["pdm_agg", "pdm_uni", "pdm_exact", "dppo_topk_kl"]
    sweep = make_sweep(uri, "holm", [f"mask={','.join(masks)}", "seed=0,1,2,3"])
    rng = np.random.default_rng(1)
    values = {}
    for seed in range(4):
        base = rng.uniform(0.25, 0.45)
        for i, mask in enumerate(masks):
            values[mask, seed] = (base + 0.01 * i + rng.normal(0, 0.01), base + rng.normal(0, 0.01))
            write_points(sweep.ledger, [(sweep.run_id(mask, seed), "eval/toy24", 4, values[mask, seed][0]),
                                        (sweep.run_id(mask, seed), "eval/toy25", 4, values[mask, seed][1])])  # fmt: skip
    finish(sweep.ledger, list(sweep.specs))
    report = build_report(sweep.ledger, ["holm"], load_definition("default"))
    assert len(report.comparisons) == 3
    for j, label in enumerate(("AIME24", "AIME25")):
        raw = []
        for comp in report.comparisons:
            d = [values[comp.row.mask, s][j] - values["dppo_topk_kl", s][j] for s in range(4)]
            assert comp.cells[label].p_value == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue, rel=1e-6)
            raw.append(comp.cells[label].p_value)
        assert [c.cells[label].p_holm for c in report.comparisons] == pytest.approx(holm(raw))
    table = comparison_table(report)
    holm_column = table.headers.index("Holm")  # a column of its own, a number on every line
    assert all(float(row[holm_column]) >= float(row[holm_column - 1]) for row in table.rows)
    for rendering in (to_markdown(table), to_html(table), to_latex(table)):
        assert "step-down procedure over the 3 comparisons of each column" in rendering
    rows = list(csv.DictReader(io.StringIO(comparison_csv(report))))
    assert {r["mask"] for r in rows} == set(masks[:3])
    assert all(float(r["Average p Holm"]) >= float(r["Average p"]) for r in rows)
