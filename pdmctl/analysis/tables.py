"""The direction analysis's tables (rows for the terminal, the report and the results' markdown) and its
per-seed CSV."""

from __future__ import annotations

from rich.table import Table

from pdmctl.analysis.protocols import PROTOCOLS
from pdmctl.analysis.results import ESTIMATORS, AnalysisResult


def _pct(mean: float | None, se: float | None = None) -> str:
    if mean is None:
        return "—"
    return f"{100 * mean:.1f}%" if se is None else f"{100 * mean:.1f} ± {100 * se:.1f}%"


ANALYSIS_COLUMNS = (
    "criterion",
    "estimator",
    "disagreement tokens / seed",
    "unsafe-keep (mean ± s.e.)",
    "corrective (pooled)",
    "kept (pooled)",
    "wins (seeds)",
)


def analysis_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    """The table's rows: for each estimator, the ratio criterion and the predictive one on the same tokens."""
    rows: list[tuple[str, ...]] = []
    for c in result.comparisons:
        per_seed = f"{sum(c.disagreement_per_seed) / max(len(c.disagreement_per_seed), 1):.1f}"
        for name, stats, wins in (
            ("ratio", c.ratio, c.ratio_wins),
            ("predictive", c.predictive, c.predictive_wins),
        ):
            rows.append(
                (
                    name,
                    c.estimator,
                    per_seed,
                    _pct(stats.unsafe_keep_mean, stats.unsafe_keep_se),
                    _pct(stats.corrective_pooled),
                    str(stats.kept_pooled),
                    f"{wins}/{c.seeds_compared}",
                )
            )
    return rows


def _table(title: str, columns: tuple[str, ...], text_columns: int, rows: list[tuple[str, ...]]) -> Table:
    """A rich table: the first `text_columns` columns left-aligned, the numbers right-aligned."""
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < text_columns else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _update_words(protocol: str) -> str:
    if protocol == "counterfactual":  # the decision in one real update, not the decision in general
        return ("one Adam update on the whole batch after the step's first mini-batch updates, with the clip "
                "factor of each member's own gradient norm: keep minus mask (counterfactual)")
    return f"a {protocol} update"


def render_analysis_table(result: AnalysisResult) -> Table:
    n = max(len(result.seeds), 1)
    title = (
        f"Direction analysis: {len(result.seeds)} seeds, {result.divergence} δ={result.delta} K={result.k} "
        f"{result.precision}{', mismatch only (fresh rollout)' if result.setting == 'mismatch-only' else ''}, "
        f"ΔD after {_update_words(result.protocol)}; {sum(result.out_of_region_per_seed) / n:.0f} of "
        f"{sum(result.tokens_per_seed) / n:.0f} tokens per seed outside the region"
    )
    return _table(title, ANALYSIS_COLUMNS, 2, analysis_rows(result))


DIFFERENCE_COLUMNS = ("measure", "estimators", "mean difference", "95% interval", "seeds")


def _points(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.1f}"


def difference_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    """The paired differences between estimators, in percentage points."""
    return [
        (
            d.measure,
            f"{d.first} − {d.second}",
            _points(d.mean),
            "n/a" if d.low is None else f"[{_points(d.low)}, {_points(d.high)}]",
            str(d.seeds),
        )
        for d in result.estimator_differences
    ]


def render_difference_table(result: AnalysisResult) -> Table:
    title = (
        f"Estimators compared, predictive criterion: per-seed differences, mean and "
        f"{100 * result.level:.0f}% t-interval over {len(result.seeds)} seeds (percentage points)"
    )
    return _table(title, DIFFERENCE_COLUMNS, 2, difference_rows(result))


PROTOCOL_COLUMNS = (
    "estimator",
    "protocol",
    "unsafe-keep ratio",
    "unsafe-keep predictive",
    "corrective ratio",
    "corrective predictive",
    "wins ratio/predictive",
)


def protocol_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    """Each estimator's comparison under every protocol, side by side (the main one first)."""
    rows: list[tuple[str, ...]] = []
    for i, estimator in enumerate(ESTIMATORS):
        for protocol, comparisons in result.protocol_comparisons.items():
            c = comparisons[i]
            rows.append(
                (
                    estimator,
                    protocol + (" (main)" if protocol == result.protocol else ""),
                    _pct(c.ratio.unsafe_keep_mean, c.ratio.unsafe_keep_se),
                    _pct(c.predictive.unsafe_keep_mean, c.predictive.unsafe_keep_se),
                    _pct(c.ratio.corrective_pooled),
                    _pct(c.predictive.corrective_pooled),
                    f"{c.ratio_wins}/{c.predictive_wins} of {c.seeds_compared}",
                )
            )
    return rows


def render_protocol_table(result: AnalysisResult) -> Table:
    title = "ΔD under each update protocol, same disagreement tokens: " + "; ".join(
        f"{p}: {PROTOCOLS[p]}" for p in result.protocol_comparisons
    )
    return _table(title, PROTOCOL_COLUMNS, 2, protocol_rows(result))


DECOMPOSITION_COLUMNS = (
    "protocol",
    "criterion",
    "tokens",
    "share own",
    "share others",
    "share mom.",
    "sign 1st order",
    "sign own",
    "sign others",
    "sign mom.",
    "sign own logit",
    "own last layer",
    "1st-order error",
)


def decomposition_table_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    return [
        (
            r.protocol + (" (main)" if r.protocol == result.protocol else ""),
            r.criterion.replace("predictive/", "pred. "),
            str(r.tokens),
            _pct(r.own_share),
            _pct(r.others_share),
            _pct(r.momentum_share),
            _pct(r.first_order_sign),
            _pct(r.own_sign),
            _pct(r.others_sign),
            _pct(r.momentum_sign),
            _pct(r.own_logit_sign),
            _pct(r.own_last_layer_share),
            _pct(r.first_order_error),
        )
        for r in result.decomposition
    ]


def render_decomposition_table(result: AnalysisResult) -> Table:
    title = (
        "ΔD decomposed: first-order ΔD = own + others + momentum, over the out-of-region tokens with A ≠ 0 "
        "each criterion keeps (seeds pooled). share: median |piece| / (|own| + |others| + |momentum|); sign: "
        "share of tokens whose piece has the realized ΔD's sign; own last layer: median share of the head in "
        "the own effect; 1st-order error: median |realized − first order| / |realized|"
    )
    return _table(title, DECOMPOSITION_COLUMNS, 2, decomposition_table_rows(result))


ASSUMPTION_COLUMNS = (
    "a token's own effect on its D",
    "tokens",
    "sign = sign(A·Ḋ_exact)",
    "sign = sign(A(r − 1))",
    "last-layer share",
)


def assumption_table_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    return [
        (r.own_effect, str(r.tokens), _pct(r.agrees_exact), _pct(r.agrees_ratio), _pct(r.last_layer_share))
        for r in result.logit_assumption
    ]


def render_assumption_table(result: AnalysisResult) -> Table:
    title = (
        "The predictive criterion's assumption: a token's update moves its logits along e_k − π. Out-of-region "
        "tokens with A ≠ 0, each one's own gradient as if kept; agreement of its sign with each criterion's"
    )
    return _table(title, ASSUMPTION_COLUMNS, 1, assumption_table_rows(result))


SEED_CSV_COLUMNS = (
    "seed",
    "protocol",
    "estimator",
    "tokens",
    "out_of_region",
    "disagreements",
    "ratio_kept",
    "ratio_unsafe_keep",
    "ratio_corrective",
    "predictive_kept",
    "predictive_unsafe_keep",
    "predictive_corrective",
    "ratio_update_own_share",
    "ratio_update_others_share",
    "ratio_update_momentum_share",
    "predictive_update_own_share",
    "predictive_update_others_share",
    "predictive_update_momentum_share",
)


def seed_csv(result: AnalysisResult) -> str:
    """One row per seed, protocol and estimator: the rates and counts, and the median shares of the
    decomposition of the ratio criterion's and the predictive criterion's update (empty where none)."""
    import csv
    import io

    decomposed = {(r.protocol, r.criterion): r for r in result.decomposition}

    def cell(value) -> str:
        return "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(SEED_CSV_COLUMNS)
    for protocol, comparisons in result.protocol_comparisons.items():
        for c in comparisons:
            ratio_row = decomposed.get((protocol, "ratio"))
            pred_row = decomposed.get((protocol, f"predictive/{c.estimator}"))
            for i, seed in enumerate(result.seeds):
                shares = [
                    getattr(row, f"{piece}_share_per_seed")[i] if row is not None else None
                    for row in (ratio_row, pred_row)
                    for piece in ("own", "others", "momentum")
                ]
                values = [
                    seed,
                    protocol,
                    c.estimator,
                    result.tokens_per_seed[i],
                    result.out_of_region_per_seed[i],
                    c.disagreement_per_seed[i],
                    c.ratio.kept_per_seed[i] if c.ratio.kept_per_seed else None,
                    c.ratio.unsafe_keep_per_seed[i],
                    c.ratio.corrective_per_seed[i],
                    c.predictive.kept_per_seed[i] if c.predictive.kept_per_seed else None,
                    c.predictive.unsafe_keep_per_seed[i],
                    c.predictive.corrective_per_seed[i],
                    *shares,
                ]
                writer.writerow([cell(v) for v in values])
    return out.getvalue()
