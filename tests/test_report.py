"""pdmctl report: its statistics against scipy and by hand, and whole reports on real SQLite MLflow stores."""

from __future__ import annotations

import csv
import html
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps
from typer.testing import CliRunner

from pdmctl import grid
from pdmctl.backends.toy import ToyConfig
from pdmctl.ledger import FAILED, KILLED, RunLogger
from pdmctl.report import power, resample
from pdmctl.report.build import baseline_row, build_report
from pdmctl.report.collect import RowKey
from pdmctl.report.definition import At, Confidence, ReportError, load_definition, parse_definition
from pdmctl.report.stats import (
    Estimate,
    Interval,
    format_estimate,
    paired_difference,
    probability_of_improvement,
    probability_of_improvement_paired,
    select_steps,
    t_estimates,
    values_at,
    welch_interval,
)
from pdmctl.report.tables import (
    comparison_csv,
    excluded_table,
    methods,
    power_table,
    results_csv,
    results_table,
    seeds_csv,
)
from pdmctl.report.write import write_report

sys.path.insert(0, str(Path(__file__).parent))  # the synthetic-sweep helpers beside this file
from test_report_synthetic import SyntheticSweep, finish, make_sweep, write_points

CONF = Confidence(level=0.95, method="percentile", resamples=2000, seed=7)
EVAL_STEPS = (0, 2, 4)


def definition(**changes):
    return load_definition("default").with_options(**changes)


def uri_in(directory: Path) -> str:
    return f"sqlite:///{directory / 'mlflow.db'}"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite MLflow store for the module (MLflow's schema takes seconds to create); a sweep per test."""
    return uri_in(tmp_path_factory.mktemp("store"))


def log_evals(sweep: SyntheticSweep, run_id: str, final: tuple[float, float], steps=EVAL_STEPS) -> None:
    """eval/toy24 and eval/toy25 rising linearly to `final` at the last step; a little training dynamics."""
    points = []
    for i, step in enumerate(steps):
        frac = (i + 1) / len(steps)
        points += [(run_id, "eval/toy24", step, final[0] * frac), (run_id, "eval/toy25", step, final[1] * frac),
                   (run_id, "train/reward", step, 0.2 + 0.1 * frac), (run_id, "train/response_length", step, 3.0),
                   (run_id, "train/ppo_kl", step, 0.01 / (1 + i)), (run_id, "train/mask_frac", step, 0.05)]  # fmt: skip
    write_points(sweep.ledger, points)


# ---------------------------------------------------------------------------
# Statistics: against scipy, and by hand
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["percentile", "bca"])
def test_seed_intervals_equal_scipy_bootstrap_on_the_same_data_and_seed(method: str) -> None:
    rng = np.random.default_rng(3)
    samples = [list(rng.random(5)), list(rng.random(3)), list(rng.random(5)), [0.4], []]
    conf = Confidence(method=method, resamples=3000, seed=11)
    estimates = resample.seed_intervals(samples, conf)
    for sample, estimate in zip(samples, estimates, strict=True):
        assert estimate.n == len(sample)
        if len(sample) < 2:
            assert estimate.interval is None  # n/a, never a zero-width interval
            continue
        ref = sps.bootstrap((np.array(sample),), np.mean, n_resamples=3000, confidence_level=0.95,
                            method="BCa" if method == "bca" else "percentile",
                            rng=np.random.default_rng(11)).confidence_interval  # fmt: skip
        assert estimate.interval == Interval(ref.low, ref.high)
        assert estimate.mean == pytest.approx(np.mean(sample))


def test_paired_difference_interval_equals_scipy_paired_bootstrap() -> None:
    rng = np.random.default_rng(5)
    x, y = rng.random(6), rng.random(6)
    ours = resample.seed_interval(list(x - y), CONF).interval
    ref = sps.bootstrap((x, y), lambda a, b, axis=-1: np.mean(a, axis=axis) - np.mean(b, axis=axis), paired=True,
                        n_resamples=CONF.resamples, method="percentile", rng=np.random.default_rng(CONF.seed),
                        vectorized=True).confidence_interval  # fmt: skip
    assert ours is not None
    assert ours.low == pytest.approx(ref.low, abs=1e-12) and ours.high == pytest.approx(ref.high, abs=1e-12)


def test_hand_computed_interval_two_seeds() -> None:
    # resampling two seeds [0.2, 0.4]: means 0.2 (p=1/4), 0.3 (1/2), 0.4 (1/4); the 2.5% and 97.5% quantiles
    # of that distribution are its ends, so the 95% percentile interval is [0.2, 0.4] around the mean 0.3
    estimate = resample.seed_interval([0.2, 0.4], Confidence(method="percentile", resamples=10000, seed=0))
    assert estimate.mean == pytest.approx(0.3)
    assert estimate.interval == Interval(pytest.approx(0.2), pytest.approx(0.4))
    # constant data: BCa is undefined there, the fallback gives the value itself, not NaN
    constant = resample.seed_interval([0.5, 0.5, 0.5], Confidence(method="bca", resamples=500))
    assert constant.interval == Interval(pytest.approx(0.5), pytest.approx(0.5))


def test_t_intervals_equal_scipy_and_hand_computed() -> None:
    # two seeds [0.2, 0.4]: s = 0.1414, t(1, 0.975) = 12.706, half-width 12.706 · 0.1414 / √2 = 1.2706
    (two,) = t_estimates([[0.2, 0.4]], 0.95)
    assert two.interval == Interval(pytest.approx(0.3 - 1.27062), pytest.approx(0.3 + 1.27062))
    rng = np.random.default_rng(4)
    samples = [list(rng.random(5)), list(rng.random(3)), list(rng.random(5)), [0.4], []]
    for sample, estimate in zip(samples, t_estimates(samples, 0.9), strict=True):
        if len(sample) < 2:
            assert estimate.interval is None
            continue
        ref = sps.ttest_1samp(sample, 0.0).confidence_interval(confidence_level=0.9)
        assert estimate.interval == Interval(pytest.approx(ref.low), pytest.approx(ref.high))
    x, y = rng.random(4), rng.random(6)
    ref = sps.ttest_ind(x, y, equal_var=False).confidence_interval(confidence_level=0.95)
    assert welch_interval(list(x), list(y), 0.95) == Interval(pytest.approx(ref.low), pytest.approx(ref.high))
    assert welch_interval([0.3, 0.3], [0.1, 0.1], 0.95) == Interval(pytest.approx(0.2), pytest.approx(0.2))
    paired = paired_difference(list(x), list(rng.random(4)))
    assert paired.n == 4 and paired.interval is not None
    with pytest.raises(ValueError, match="pairs need equal lengths"):
        paired_difference([0.1, 0.2], [0.1])


def test_hand_computed_probability_of_improvement_and_formatting() -> None:
    assert probability_of_improvement_paired([0.1, -0.1, 0.0, 0.2]) == pytest.approx(0.625)
    assert probability_of_improvement([1.0, 2.0], [1.5]) == pytest.approx(0.5)
    assert probability_of_improvement([1.0, 2.0], [1.0, 2.0]) == pytest.approx(0.5)  # (½ + 0 + 1 + ½) / 4
    assert math.isnan(probability_of_improvement_paired([]))
    assert format_estimate(Estimate(0.3421, 3, Interval(0.31, 0.375))) == "34.2 [31.0, 37.5]"
    assert format_estimate(Estimate(0.3421, 1, None)) == "34.2 [n/a]"
    assert format_estimate(Estimate(math.nan, 0, None)) == "n/a"
    assert format_estimate(Estimate(0.021, 4, Interval(-0.005, 0.04)), signed=True) == "+2.1 [-0.5, +4.0]"


def test_two_level_bootstrap_by_hand() -> None:
    # one problem per seed: resampling problems changes nothing, so it is the seed bootstrap's [0.2, 0.4]
    est = resample.two_level_interval([np.array([[0.2], [0.4]])], Confidence(resamples=10000))
    assert est.mean == pytest.approx(0.3) and est.interval == Interval(pytest.approx(0.2), pytest.approx(0.4))
    # one seed: n/a, however many problems
    assert resample.two_level_interval([np.array([[0.0, 1.0, 0.5]])], CONF).interval is None
    # identical seeds: the interval is the problems' own spread, wider than the (zero) spread over seeds
    same = np.tile([0.0, 0.25, 0.5, 0.75, 1.0], (3, 1))
    iv = resample.two_level_interval([same], CONF).interval
    assert iv is not None and iv.low < 0.5 < iv.high and iv.width > 0.2


def test_selecting_the_evaluation() -> None:
    scores = {0: 0.1, 2: 0.5, 4: 0.3, 6: math.nan}
    assert select_steps(scores, At.parse("final")) == [6]
    assert select_steps(scores, At.parse("best")) == [2]  # never a NaN step
    assert select_steps(scores, At.parse("last-2")) == [4, 6]
    assert select_steps({}, At.parse("best")) == []
    values, steps = values_at({"A": [(0, 0.1), (2, 0.3)], "B": [(0, 0.5), (2, 0.1), (4, 0.9)]}, At.parse("best"))
    assert steps == [0] and values == {"A": 0.1, "B": 0.5}  # the columns' mean picks the step, both read there
    for bad in ("worst", "last-0", "last-x"):
        with pytest.raises(ReportError):
            At.parse(bad)


def test_definition_errors_are_one_line() -> None:
    with pytest.raises(ReportError, match=r"confidence\.method"):
        parse_definition({"columns": [{"label": "A", "metrics": ["eval/a"]}], "confidence": {"method": "basic"}})
    with pytest.raises(ReportError, match="unknown field"):
        parse_definition({"columns": [{"label": "A", "metrics": ["eval/a"]}], "colour": "red"})
    with pytest.raises(ReportError, match="not found"):
        load_definition("no-such-report")
    d = load_definition("default")
    assert [c.label for c in d.columns] == ["AIME24", "AIME25"] and d.baseline == "dppo_topk_kl"
    assert d.columns[0].metrics == ("eval/aime24", "eval/toy24")


def test_baseline_row_matching() -> None:
    dppo = [RowKey("s", "dppo_topk_kl", (("δ", "0.1"), ("K", "20"))),
            RowKey("s", "dppo_topk_kl", (("δ", "0.2"), ("K", "20")))]  # fmt: skip
    assert baseline_row(RowKey("s", "pdm_agg", (("δ", "0.2"), ("K", "20"))), dppo, "dppo_topk_kl") == dppo[1]
    # GRPO has no δ: two baseline rows remain, neither is the one to compare with
    assert baseline_row(RowKey("s", "grpo_clip_higher", (("δ", "—"), ("K", "20"))), dppo, "dppo_topk_kl") is None
    assert baseline_row(RowKey("other", "pdm_agg", (("δ", "0.2"), ("K", "20"))), dppo, "dppo_topk_kl") is None


# ---------------------------------------------------------------------------
# Whole reports on a real store
# ---------------------------------------------------------------------------


def test_known_paired_difference_is_recovered(store: str) -> None:
    sweep = make_sweep(store, "paired", ["mask=pdm_agg,dppo_topk_kl", "seed=0,1,2,3,4,5,6,7"])
    rng = np.random.default_rng(0)
    truth = 0.05  # PDM is 5 points better on both sets, on top of a seed effect shared by both masks
    baseline_values = {}
    for seed in range(8):
        seed_effect = rng.uniform(0.25, 0.45)
        base = (seed_effect, seed_effect - 0.03)
        baseline_values[seed] = base
        noise = rng.normal(0, 0.01, 2)
        log_evals(sweep, sweep.run_id("dppo_topk_kl", seed), base)
        log_evals(sweep, sweep.run_id("pdm_agg", seed), (base[0] + truth + noise[0], base[1] + truth + noise[1]))
    finish(sweep.ledger, list(sweep.specs))
    report = build_report(sweep.ledger, ["paired"], definition())

    assert report.excluded == [] and len(report.rows) == 2 and report.dims == ()
    (comp,) = report.comparisons
    assert comp.row.mask == "pdm_agg" and comp.baseline.mask == "dppo_topk_kl" and comp.seeds == tuple(range(8))
    for label in ("AIME24", "AIME25", "Average"):
        cell = comp.cells[label]
        assert cell.paired and cell.probability_of_improvement == 1.0
        assert cell.difference.interval is not None
        assert cell.difference.interval.low < truth < cell.difference.interval.high
        assert cell.difference.interval.low > 0  # the seed effect cancels in the pairs
    # the baseline's table cell is exactly scipy's t interval on its eight final values (the default) ...
    dppo = next(r for r in report.rows if r.row.mask == "dppo_topk_kl")
    values = np.array([baseline_values[s][0] for s in range(8)])
    ref = sps.ttest_1samp(values, 0.0).confidence_interval(confidence_level=0.95)
    assert dppo.cells["AIME24"].mean == pytest.approx(values.mean())
    assert dppo.cells["AIME24"].interval == Interval(pytest.approx(ref.low), pytest.approx(ref.high))
    # ... and scipy's percentile bootstrap with --interval percentile
    report = build_report(sweep.ledger, ["paired"], definition(interval="percentile"))
    dppo = next(r for r in report.rows if r.row.mask == "dppo_topk_kl")
    ref = sps.bootstrap((values,), np.mean, n_resamples=10000, method="percentile",
                        rng=np.random.default_rng(0)).confidence_interval  # fmt: skip
    assert dppo.cells["AIME24"].interval == Interval(pytest.approx(ref.low), pytest.approx(ref.high))
    assert report.queries <= 6  # a few bulk statements, not one per run


def test_partial_sweep_one_seed_rows_and_nan_metrics(store: str, tmp_path: Path) -> None:
    """The documented output: every run that does not count is listed with its reason; rows with one seed
    show [n/a] intervals; nothing crashes and nothing bad is averaged in."""
    sweep = make_sweep(store, "partial", ["mask=pdm_agg,dppo_topk_kl,pdm_uni", "seed=0,1,2"])
    ids = {(s.config["mask"]["name"], s.seed): rid for rid, s in sweep.specs.items()}
    for seed in (0, 1, 2):
        log_evals(sweep, ids["dppo_topk_kl", seed], (0.3 + 0.01 * seed, 0.25))
    log_evals(sweep, ids["pdm_agg", 0], (0.35, 0.3))
    log_evals(sweep, ids["pdm_agg", 1], (0.36, 0.31))
    log_evals(sweep, ids["pdm_agg", 2], (0.9, 0.9), steps=(0, 2))  # died after step 2
    log_evals(sweep, ids["pdm_uni", 0], (0.33, 0.28), steps=(0, 2))  # finished, but stopped early: partial
    log_evals(sweep, ids["pdm_uni", 1], (0.34, 0.29))
    write_points(sweep.ledger, [(ids["pdm_uni", 2], "eval/toy24", 4, math.nan),  # NaN, as MLflow stores it
                                (ids["pdm_uni", 2], "eval/toy25", 4, 0.3)])  # fmt: skip
    finish(sweep.ledger, [rid for key, rid in ids.items() if key != ("pdm_agg", 2)])
    finish(sweep.ledger, [ids["pdm_agg", 2]], FAILED, "out of memory")
    report = build_report(sweep.ledger, ["partial"], definition())

    by_mask = {r.row.mask: r for r in report.rows}
    assert by_mask["dppo_topk_kl"].seeds == (0, 1, 2)
    assert by_mask["pdm_agg"].seeds == (0, 1)
    assert by_mask["pdm_uni"].seeds == (1,)
    assert by_mask["pdm_uni"].cells["AIME24"].interval is None
    assert by_mask["pdm_agg"].cells["AIME24"].mean == pytest.approx(0.355)  # the failed run is not in it
    reasons = {(e.row.mask, e.seed): (e.status, e.reason) for e in report.excluded if e.row}
    assert reasons["pdm_agg", 2][0] == FAILED and "not finished" in reasons["pdm_agg", 2][1]
    assert "partial: last evaluation at step 2" in reasons["pdm_uni", 0][1]
    assert "AIME24 not finite" in reasons["pdm_uni", 2][1]
    assert len(report.excluded) == 3

    table = results_table(report)
    uni = next(row for row in table.rows if row[1] == "pdm_uni")
    assert uni[2:5] == ("34.0", "n/a", "n/a") and uni[-1] == "1"  # mean, low, high: one seed, no interval
    rows = list(csv.DictReader(io.StringIO(results_csv(report))))
    uni_csv = next(r for r in rows if r["mask"] == "pdm_uni")
    assert uni_csv["toy24 mean (%)"] == "34.0000" and uni_csv["toy24 low (%)"] == ""  # the set the runs logged
    comps = {c.row.mask: c for c in report.comparisons}
    assert comps["pdm_uni"].seeds == (1,) and comps["pdm_uni"].cells["Average"].difference.interval is None
    assert "n/a" not in comparison_csv(report).splitlines()[0]
    excluded = excluded_table(report)
    assert {r[-3] for r in excluded.rows} == {"failed", "finished"}
    written = write_report(report, tmp_path / "out")
    assert {p.name for p in written} >= {"index.html", "results.md", "results.csv", "results.tex", "comparison.csv",
                                         "seeds.csv"}  # fmt: skip
    assert "| 34.0 | n/a | n/a |" in (tmp_path / "out" / "results.md").read_text()
    # seeds.csv: the value behind each mean, one line per row and seed; the table's means are theirs
    per_seed = list(csv.DictReader(io.StringIO(seeds_csv(report))))
    agg = [r for r in per_seed if r["mask"] == "pdm_agg"]
    assert [r["seed"] for r in agg] == ["0", "1"]
    assert sum(float(r["toy24 (%)"]) for r in agg) / 2 == pytest.approx(100 * by_mask["pdm_agg"].cells["AIME24"].mean)
    assert len(per_seed) == sum(len(r.seeds) for r in report.rows)


def test_rows_split_by_varying_delta_k_and_other_fields(store: str) -> None:
    sweep = make_sweep(store, "grid", ["mask=pdm_agg,dppo_topk_kl,grpo_clip_higher",
                                                   "delta=0.1,0.2", "seed=0,1"])  # fmt: skip
    other = make_sweep(store, "lr", ["mask=pdm_agg", "delta=0.1", "seed=0,1", "backend.lr=0.01"])
    for s in (sweep, other):
        for rid, spec in s.specs.items():
            log_evals(s, rid, (0.3 + spec.config["delta"], 0.2))
        finish(s.ledger, list(s.specs))
    report = build_report(sweep.ledger, ["grid", "lr"], definition())
    # δ varies (GRPO has none: its run key ignores δ, so the grid made it once); the other sweep's lr
    # differs from the grid's at the same setting, mask, δ: it becomes a column instead of being averaged in
    assert report.dims == ("δ", "backend.lr")
    labels = [r.row.label for r in report.rows]
    DEFAULT_LR = ToyConfig().lr  # the grid's runs carry the testbed's default
    assert labels[:2] == [f"dppo_topk_kl δ=0.1 backend.lr={DEFAULT_LR}", f"dppo_topk_kl δ=0.2 backend.lr={DEFAULT_LR}"]
    assert f"grpo_clip_higher backend.lr={DEFAULT_LR}" in labels
    assert "pdm_agg δ=0.1 backend.lr=0.01" in labels and len(labels) == 6
    comps = {c.row.label: c.baseline.label for c in report.comparisons}
    assert comps[f"pdm_agg δ=0.2 backend.lr={DEFAULT_LR}"] == f"dppo_topk_kl δ=0.2 backend.lr={DEFAULT_LR}"
    assert comps["pdm_agg δ=0.1 backend.lr=0.01"] == f"dppo_topk_kl δ=0.1 backend.lr={DEFAULT_LR}"
    assert f"grpo_clip_higher backend.lr={DEFAULT_LR}" not in comps  # two baseline rows fit: none is chosen


def test_best_and_last_n_read_the_histories(store: str) -> None:
    sweep = make_sweep(store, "at", ["mask=dppo_topk_kl", "seed=0,1"])
    for rid in sweep.specs:
        write_points(sweep.ledger, [(rid, "eval/toy24", 0, 0.1), (rid, "eval/toy24", 2, 0.6), (rid, "eval/toy24", 4, 0.2),
                                    (rid, "eval/toy25", 0, 0.1), (rid, "eval/toy25", 2, 0.4), (rid, "eval/toy25", 4, 0.4)])  # fmt: skip
    finish(sweep.ledger, list(sweep.specs))
    cell = {str(at): build_report(sweep.ledger, ["at"], definition(at=at)).rows[0].cells
            for at in ("final", "best", "last-2")}  # fmt: skip
    assert cell["final"]["AIME24"].mean == pytest.approx(0.2)
    assert cell["best"]["AIME24"].mean == pytest.approx(0.6) and cell["best"]["AIME25"].mean == pytest.approx(0.4)
    assert cell["last-2"]["AIME24"].mean == pytest.approx(0.4)
    assert cell["final"]["AIME24"].interval == Interval(pytest.approx(0.2), pytest.approx(0.2))  # two equal seeds


def test_two_level_bootstrap_from_logged_per_problem_scores(store: str) -> None:
    uri = store
    sweep = make_sweep(uri, "two", ["mask=dppo_topk_kl,pdm_agg", "seed=0,1,2"])
    rng = np.random.default_rng(1)
    scores = {}
    for rid, spec in sweep.specs.items():
        logger = RunLogger(uri, rid)
        for dataset in ("toy24", "toy25"):
            per_problem = rng.integers(0, 17, 12) / 16
            scores[rid, dataset] = per_problem
            if spec.config["mask"]["name"] == "dppo_topk_kl":  # pdm_agg logs no per-problem scores
                logger.log_per_problem(dataset, 4, per_problem.tolist())
        write_points(sweep.ledger, [(rid, "eval/toy24", 4, float(scores[rid, "toy24"].mean())),
                                    (rid, "eval/toy25", 4, float(scores[rid, "toy25"].mean()))])  # fmt: skip
    finish(sweep.ledger, list(sweep.specs))
    seed_level = build_report(sweep.ledger, ["two"], definition())
    report = build_report(sweep.ledger, ["two"], definition(), two_level=True)
    dppo, pdm = (next(r for r in report.rows if r.row.mask == m) for m in ("dppo_topk_kl", "pdm_agg"))
    assert dppo.two_level == {"AIME24": True, "AIME25": True, "Average": True}
    assert pdm.two_level == {} and pdm.cells == next(r for r in seed_level.rows if r.row.mask == "pdm_agg").cells
    ids = [sweep.run_id("dppo_topk_kl", s) for s in (0, 1, 2)]
    matrix = np.array([scores[rid, "toy24"] for rid in ids])
    expected = resample.two_level_interval([matrix], load_definition("default").confidence)
    assert dppo.cells["AIME24"].interval == expected.interval
    assert dppo.cells["AIME24"].mean == pytest.approx(matrix.mean())
    assert "‡" in results_table(report).rows[0][2] and "two-level" in results_table(report).note


def test_direction_analysis_table(store: str, tmp_path: Path) -> None:
    sweep = make_sweep(store, "dir", ["mask=dppo_topk_kl", "seed=0"])
    finish(sweep.ledger, list(sweep.specs), KILLED)
    stats = {"unsafe_keep_per_seed": [0.5, 0.25], "unsafe_keep_mean": 0.375, "unsafe_keep_se": 0.125,
             "corrective_pooled": 0.6, "kept_pooled": 12}  # fmt: skip
    analysis = {"seeds": [0, 1], "delta": 0.15, "k": 20, "divergence": "topk_kl", "precision": "bf16",
                "tokens_per_seed": [1000, 1000], "out_of_region_per_seed": [40, 60],
                "comparisons": [{"estimator": "agg", "disagreement_per_seed": [3, 5], "ratio": stats,
                                 "predictive": {**stats, "unsafe_keep_mean": 0.1}, "predictive_wins": 2,
                                 "ratio_wins": 0, "seeds_compared": 2}]}  # fmt: skip
    path = tmp_path / "analysis.json"
    path.write_text(json.dumps(analysis))
    report = build_report(sweep.ledger, ["dir"], definition(), analysis=path)
    out = tmp_path / "out"
    write_report(report, out)
    page = (out / "index.html").read_text()
    assert 'id="direction"' in page and "predictive" in page and "2/2" in page
    # a sweep whose only run was killed: an empty table, the run listed, no figures, no crash
    assert report.rows[0].seeds == () and report.curves == [] and "killed" in page
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ReportError, match="not a direction analysis"):
        build_report(sweep.ledger, ["dir"], definition(), analysis=tmp_path / "bad.json")


def test_the_report_says_under_each_comparison_how_many_seeds_it_needs(store: str) -> None:
    sweep = make_sweep(store, "power", ["mask=pdm_agg,dppo_topk_kl", "seed=0,1,2,3"])
    rng = np.random.default_rng(3)
    differences = []
    for seed in range(4):
        base = rng.uniform(0.2, 0.4)
        d = 0.03 + rng.normal(0, 0.04)
        differences.append(d)
        for mask, value in (("dppo_topk_kl", base), ("pdm_agg", base + d)):
            write_points(sweep.ledger, [(sweep.run_id(mask, seed), "eval/toy24", 4, value),
                                        (sweep.run_id(mask, seed), "eval/toy25", 4, value)])  # fmt: skip
    finish(sweep.ledger, list(sweep.specs))
    report = build_report(sweep.ledger, ["power"], definition())
    (comp,) = report.comparisons
    cell = comp.cells["AIME24"]
    d = np.array(differences)
    assert cell.spread == pytest.approx(d.std(ddof=1))
    assert cell.seeds_needed == power.seeds_needed(abs(d.mean()) / d.std(ddof=1)) and cell.seeds_needed > 4
    assert cell.resolvable == pytest.approx(power.resolvable(4) * d.std(ddof=1))
    table = power_table(report)
    row = table.rows[0]  # a line per column: the first column's (shown under the set the runs logged)
    assert row[3:] == ("toy24", str(cell.seeds_needed), f"{100 * cell.resolvable:.1f}", "4")
    assert "80% power" in table.title and "noncentral t" in " ".join(methods(report))
    header, first = comparison_csv(report).splitlines()[:2]
    assert "toy24 seeds for 80% power" in header and f",{cell.seeds_needed}," in first


def _samples(rng: np.random.Generator, problems: int = 6, n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Answers 0-3 per sample (-1: none), 2 the right one: many ties."""
    answers = rng.integers(-1, 4, (problems, n))
    return (answers == 2).astype(int), answers


def test_pass_and_majority_at_k_from_each_runs_stored_samples(store: str, tmp_path: Path) -> None:
    from test_report_passk import brute_force

    sweep = make_sweep(store, "passk", ["mask=pdm_agg,dppo_topk_kl", "seed=0,1,2"])
    rng = np.random.default_rng(2)
    stored = {}
    for rid, spec in sweep.specs.items():
        logger = RunLogger(store, rid)
        for dataset in ("toy24", "toy25"):
            correct, answers = _samples(rng)
            stored[rid, dataset] = (correct, answers)
            if not (spec.config["mask"]["name"] == "pdm_agg" and spec.seed == 2):  # one run stored none
                logger.log_per_problem(dataset, 4, correct.mean(1).tolist(), correct=correct.tolist(),
                                       answers=answers.tolist())  # fmt: skip
        write_points(sweep.ledger, [(rid, f"eval/{d}", 4, float(stored[rid, d][0].mean())) for d in ("toy24", "toy25")])
    finish(sweep.ledger, list(sweep.specs))
    report = build_report(sweep.ledger, ["passk"], definition())
    (row,) = report.pass_k  # pdm_agg's row lacks one run's samples: left out, never averaged in part
    assert row.row.mask == "dppo_topk_kl" and row.samples == 8 and row.ks == (1, 2, 4, 8) and row.seeds == (0, 1, 2)
    ids = [sweep.run_id("dppo_topk_kl", s) for s in (0, 1, 2)]
    for k in row.ks:
        per_seed = {kind: [] for kind in ("pass", "maj")}
        for rid in ids:
            by_problem = [brute_force(c.tolist(), a.tolist(), k) for c, a in zip(*stored[rid, "toy25"], strict=True)]
            per_seed["pass"].append(np.mean([p for p, _ in by_problem]))
            per_seed["maj"].append(np.mean([m for _, m in by_problem]))
        for kind, values in per_seed.items():
            cell = row.cells["AIME25", kind, k]
            assert cell.mean == pytest.approx(np.mean(values), abs=1e-12)
            ref = t_estimates([values], 0.95)[0].interval  # a fraction's interval, clipped to [0, 1]
            assert cell.interval == Interval(max(ref.low, 0.0), min(ref.high, 1.0))
    table = next(r for r in report.rows if r.row.mask == "dppo_topk_kl")
    assert row.cells["Average", "pass", 1].mean == pytest.approx(table.cells["Average"].mean)  # pass@1 = avg@n
    out = tmp_path / "out"
    write_report(report, out)
    lines = list(csv.DictReader(io.StringIO((out / "passk.csv").read_text())))
    assert len(lines) == 3 * 2 * 4 and {line["metric"] for line in lines} == {"pass@k", "maj@k"}
    assert 'id="passk"' in (out / "index.html").read_text()


def test_provenance_and_the_mismatch_panel_in_the_report_and_the_command(store: str, tmp_path: Path, monkeypatch) -> None:
    from pdmctl.cli import app

    sweep = make_sweep(store, "prov", ["mask=pdm_agg,dppo_topk_kl", "seed=0,1"])
    versions = {"version.pdmctl": "0.1.0", "version.verl": "0.9.1", "version.vllm": "absent",
                "version.torch": "2.13.0+cpu", "data": "addition:abc", "eval_sampling": "n=16"}  # fmt: skip
    for rid, spec in sweep.specs.items():
        log_evals(sweep, rid, (0.3 + 0.01 * spec.seed, 0.25))
        # pdm_agg's seed 1 ran on other code; the testbed's own gap for one mask, VeRL's name for the other
        commit = "b" * 40 if (spec.config["mask"]["name"], spec.seed) == ("pdm_agg", 1) else "a" * 40
        RunLogger(store, rid).record_provenance(1, f"job-{spec.seed}", {"commit": commit, "dirty": "no", **versions})
        gap = "train/rollout_probs_diff_mean" if spec.config["mask"]["name"] == "pdm_agg" else "training/rollout_probs_diff_mean"
        write_points(sweep.ledger, [(rid, name, step, value) for step in (1, 2, 3, 4)
                                    for name, value in ((gap, 0.01 * step), ("train/out_of_region_frac", 0.1),
                                                        ("train/disagreement_count", 3.0 + spec.seed))])  # fmt: skip
    finish(sweep.ledger, list(sweep.specs))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["report", "prov", "--tracking-uri", store, "--panels", "mismatch", "-o", "out"])
    assert result.exit_code == 0, result.output
    assert ("provenance: row toy-small · bf16 pdm_agg pools runs of 2 commit values (aaaaaaaaaaaa, bbbbbbbbbbbb)"
            in " ".join(result.output.split()))
    assert "Seeds for 80% power" in result.output
    # the cost block: the 4 runs' recorded attempts (to each run's end) beside the testbed's prediction
    text = " ".join(result.output.split())
    assert "Cost: hours spent and predicted" in text and "prov: from the ledger's attempt times" in text
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "figures").iterdir()) == ["mismatch_toy-small_bf16.png",
                                                                   "mismatch_toy-small_bf16.svg"]  # fmt: skip
    page = (out / "index.html").read_text()
    assert 'id="provenance"' in page and "aaaaaaaaaa, bbbbbbbbbb (!)" in page
    cost = html.unescape(page.split('<table id="cost">')[1].split("</table>")[0])
    assert page.index('id="methods"') < page.index('<table id="cost">') < page.index("<h2>Provenance</h2>")
    (row,) = [r for r in cost.split("<tr>") if "toy: toy-small bf16" in r]
    cells = [c.split(">", 1)[1] for c in row.split("</td>")[:-1]]
    assert cells[:5] == ["prov", "toy: toy-small bf16", "CPU", "4", "4"], cells
    assert float(cells[5]) >= 0 and cells[6].startswith(cells[7].split(" (")[0])
    assert ", at cap " not in cells[7]  # the testbed's figure at the length cap is its high end: not repeated
    assert "train/rollout_probs_diff_mean, training/rollout_probs_diff_mean" in html.unescape(page)  # the caption
    rows = {r["mask"]: r for r in csv.DictReader(io.StringIO((out / "results.csv").read_text()))}
    assert rows["pdm_agg"]["commit"] == f"{'a' * 40} {'b' * 40}" and rows["pdm_agg"]["pools"] == "commit"
    assert rows["dppo_topk_kl"]["pools"] == "" and rows["dppo_topk_kl"]["job ids"] == "job-0 job-1"
    assert rows["dppo_topk_kl"]["torch"] == "2.13.0+cpu"
    report = build_report(sweep.ledger, ["prov"], definition())
    (curves,) = report.curves
    lines = {line.row.mask: line for line in curves.mismatch_panels["disagreement count"]}
    assert list(lines["pdm_agg"].centre) == pytest.approx([3.5] * 4) and lines["pdm_agg"].n_seeds == 2
    # two seeds' t band of a count (3 and 4: 3.5 ± 6.4) is drawn from 0, not from -2.9
    assert list(lines["pdm_agg"].low) == [0.0] * 4 and lines["pdm_agg"].high[0] == pytest.approx(3.5 + 12.706 * 0.5, abs=0.01)
    assert list(curves.mismatch_panels["rollout/trainer gap"][0].steps) == [1, 2, 3, 4]
    bad = CliRunner().invoke(app, ["report", "prov", "--tracking-uri", store, "--panels", "eval,curves"])
    assert bad.exit_code == 2 and "--panels: 'curves' is not one of eval, dynamics, mismatch" in bad.output


def test_a_job_records_its_provenance_and_each_attempt(store: str, tmp_path: Path, monkeypatch) -> None:
    """A real job (the synthetic backend: the job's path, not the training, is under test), run twice as a
    requeue would: the report's provenance row names this checkout's commit, the versions and both attempts.
    The testbed's own part (data digest, evaluation sampling) from its backend hook."""
    import subprocess
    from importlib import metadata

    import torch

    from pdmctl import job
    from pdmctl.backends.registry import flat_config, get_backend

    sweep = make_sweep(store, "job", ["backend=synthetic", "model=synthetic", "mask=pdm_agg", "seed=0"])
    ((rid, spec),) = sweep.specs.items()
    job_file = tmp_path / "job.json"
    job.JobFile(rid, store, spec.to_json(), str(tmp_path / "run"), 1, "local").write(job_file)
    monkeypatch.setenv("PDMCTL_JOB_ID", "first")
    assert job.run(job_file) == 0
    monkeypatch.setenv("PDMCTL_JOB_ID", "second")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert job.run(job_file) == 0
    (record,) = sweep.ledger.runs("job")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    assert record.provenance["commit"] == head and record.provenance["version.torch"] == torch.__version__
    assert record.provenance["dirty"] in ("yes", "no") and record.provenance["version.pdmctl"] == metadata.version("pdmctl")
    assert [(a["attempt"], a["job_id"], a["requeues"]) for a in record.attempts] == [(1, "first", 0), (2, "second", 1)]
    (row,) = build_report(sweep.ledger, ["job"], definition()).provenance
    assert row.attempts == 2 and row.job_ids == ("first", "second") and row.values["commit"] == (head,)
    assert row.mixed == () and row.values["data"] == ("not recorded",)  # the synthetic backend has no data
    toy = dict(flat_config(grid.expand(["seed=0", "backend.eval_samples=4"], sweep="t")[0].config))
    fields = get_backend("toy").provenance(toy, tmp_path)
    assert fields["eval_sampling"] == "n=4 temperature=1.0 top_p=1.0 max_tokens=4"
    assert fields["data"].startswith("addition:") and fields == get_backend("toy").provenance(toy, tmp_path)
    llm = get_backend("toy").provenance({**toy, "model": "toy-llm"}, tmp_path)
    assert llm["data"].startswith("chain:") and llm["data"] != fields["data"]


def test_a_tiny_engine_runs_data_is_where_its_job_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen3-tiny's job reads the data built beside its model ($PDMCTL_TINY_DIR/data), not the run's data_dir:
    the provenance digests those files (an engine sweep's report said `missing: train.parquet`)."""
    from pdmctl.backends.registry import flat_config, get_backend
    from pdmctl.backends.verl import launch
    from pdmctl.provenance import file_digest

    tiny = tmp_path / "tiny"
    monkeypatch.setenv(launch.TINY_DIR_ENV, str(tiny))
    verl = dict(flat_config(grid.expand(["backend=verl", "model=qwen3-tiny"], sweep="t")[0].config))
    assert get_backend("verl").provenance(verl, tmp_path)["data"] == "missing: train.parquet"  # not built yet
    (tiny / "data").mkdir(parents=True)
    names = [launch.MODEL_PRESETS["qwen3-tiny"].train_file, *launch.VAL_FILES]
    for i, name in enumerate(names):
        (tiny / "data" / name).write_bytes(bytes([i]) * 10)
    fields = get_backend("verl").provenance(verl, tmp_path)
    assert fields["data"] == file_digest([tiny / "data" / n for n in names]) and len(fields["data"]) == 16


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


def _small_sweep(store: str, name: str = "cli") -> str:
    make_sweep(store, f"{name}-other", ["mask=pdm_agg", "seed=0"])  # a second sweep: a bare `report` must ask
    sweep = make_sweep(store, name, ["mask=pdm_agg,dppo_topk_kl", "seed=0,1"])
    for rid, spec in sweep.specs.items():
        log_evals(sweep, rid, (0.3 + 0.02 * spec.seed, 0.25))
    finish(sweep.ledger, list(sweep.specs))
    return store


def test_report_command_writes_every_output_and_rejects_mistakes_in_one_line(store: str, tmp_path: Path, monkeypatch) -> None:
    from pdmctl.cli import app

    uri = _small_sweep(store)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runner = CliRunner()
    result = runner.invoke(app, ["report", "cli", "--tracking-uri", uri, "--at", "last-2"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "reports" / "cli"
    assert "avg@16 (cli)" in result.output and "vs dppo_topk_kl" in result.output
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert names == {"index.html", "results.md", "results.csv", "results.tex", "comparison.csv", "seeds.csv",
                     *(f"figures/{kind}_toy-small_bf16.{ext}" for kind in ("curves", "dynamics") for ext in ("png", "svg"))}  # fmt: skip
    tex = (out / "results.tex").read_text()
    assert r"\toprule" in tex and r"\midrule" in tex and r"\bottomrule" in tex and "dppo\\_topk\\_kl" in tex
    for args, message in ((["nope"], "sweep 'nope': no runs"), (["cli", "--at", "worst"], "--at: 'worst'"),
                          (["cli", "--baseline", "nope"], "--baseline: mask 'nope'"),
                          (["cli", "-d", "nope"], "report definition: 'nope' not found"),
                          ([], "sweeps in")):  # fmt: skip
        bad = runner.invoke(app, ["report", "--tracking-uri", uri, "--out", str(tmp_path / "x"), *args])
        assert bad.exit_code == 2, (args, bad.output)
        assert message in bad.output and "Traceback" not in bad.output
    (tmp_path / "empty").mkdir()
    missing = runner.invoke(app, ["report", "--tracking-uri", uri_in(tmp_path / "empty")])
    assert missing.exit_code == 2 and "no ledger" in missing.output


def test_every_table_and_figure_names_its_interval(store: str, tmp_path: Path, monkeypatch) -> None:
    from pdmctl.cli import app
    from pdmctl.report import plots

    uri = _small_sweep(store, "names")
    titles: list[str] = []
    draw = plots._panels
    monkeypatch.setattr(plots, "_panels", lambda title, *a: titles.append(title) or draw(title, *a))
    for flag, name, sentence in (([], "95% t", "Student's t interval over seeds"),
                                 (["--interval", "percentile"], "95% percentile bootstrap",
                                  "percentile bootstrap over seeds")):  # fmt: skip
        out = tmp_path / name
        titles.clear()
        result = CliRunner().invoke(app, ["report", "names", "--tracking-uri", uri, "--out", str(out), *flag])
        assert result.exit_code == 0, result.output
        terminal = " ".join(result.output.split())  # rich wraps the captions
        assert terminal.count(f"{name} intervals") == 2  # the results and the comparison table
        assert sentence in terminal
        for page in ("results.md", "index.html", "results.tex"):
            text = html.unescape((out / page).read_text()).replace("\\%", "%")
            assert text.count(f"{name} intervals") == 2 and sentence in text, page
        assert titles and all(title.endswith(f"{name} band") for title in titles)  # drawn into every PNG
        md = (out / "results.md").read_text()
        # every figure's alt text and caption names its band; the Methods block says once how it is made
        assert md.count(f"band = {name} band (Methods)") == 2 * len(titles) and md.count("## Methods") == 1
        for table in ("results.csv", "comparison.csv"):
            rows = list(csv.DictReader(io.StringIO((out / table).read_text())))
            assert rows and all(r["interval"].startswith(name) for r in rows), table
    bad = CliRunner().invoke(app, ["report", "names", "--tracking-uri", uri, "--interval", "basic"])
    assert bad.exit_code == 2 and "--interval: 'basic'" in bad.output


def test_report_needs_a_sweep_name_when_the_ledger_has_several(tmp_path, monkeypatch) -> None:
    from pdmctl.report.cli import _choose_sweeps

    assert _choose_sweeps([], ["a"], "u") == ["a"]
    assert "name one or more (a, b)" in _choose_sweeps([], ["a", "b"], "u")
    assert _choose_sweeps(["b", "a", "b"], ["a", "b"], "u") == ["b", "a"]
    assert "no sweeps" in _choose_sweeps([], [], "u")


def test_report_type_is_importable_without_heavy_modules() -> None:
    import subprocess
    import sys

    code = ("import sys, pdmctl.report.cli; "
            "print(sorted(m for m in ('matplotlib', 'scipy', 'torch') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_report_refuses_to_pool_runs_trained_on_different_data(store: str, tmp_path: Path, monkeypatch) -> None:
    """VeRL runs of one setting on two data manifests (backend.data_manifest, pinned at submit): one line,
    exit 2, nothing written; each data set's runs alone: a report."""
    pytest.importorskip("verl")  # a VeRL run config is checked against VeRL's schema
    from pdmctl.cli import app

    a, b = "a" * 64, "b" * 64
    grid_ = ["backend=verl", "model=qwen3-4b-base", "mask=pdm_agg,dppo_topk_kl", "seed=0,1"]
    mixed = make_sweep(store, "data-mixed", [*grid_, f"backend.data_manifest={a},{b}"])
    alone = make_sweep(store, "data-alone", [*grid_, f"backend.data_manifest={a}"])
    for sweep in (mixed, alone):
        write_points(sweep.ledger, [(rid, m, step, 0.1 * step + 0.01 * s.seed) for rid, s in sweep.specs.items()
                                    for m in ("eval/aime24", "eval/aime25") for step in (0, 1, 2)])  # fmt: skip
        finish(sweep.ledger, list(sweep.specs))
    monkeypatch.chdir(tmp_path)
    bad = CliRunner().invoke(app, ["report", "data-mixed", "--tracking-uri", store, "--panels", "none", "-o", "out"])
    assert bad.exit_code == 2, bad.output
    lines = bad.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: setting qwen3-4b-base · bf16: its runs were trained on "
                                                   "different data (aaaaaaaaaaaaaaaa in 4 run(s), bbbbbbbbbbbbbbbb in 4 run(s)")
    assert not (tmp_path / "out").exists()
    ok = CliRunner().invoke(app, ["report", "data-alone", "--tracking-uri", store, "--panels", "none", "-o", "out"])
    assert ok.exit_code == 0, ok.output
