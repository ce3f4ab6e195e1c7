"""The run's regime beside the paper's §4.2 (MATH.md, "The token-level direction analysis"): the share of the
response tokens outside the region, the share of those on which the two criteria disagree, and the realized
unsafe-keep rate (ΔD after the step training takes, `carried`). The paper's seeds: 1,435 tokens out of the
region in a rollout of 1,024 sequences (1.4 per sequence; their share of the response tokens is not given),
about 82 of them disagreement tokens (5.7%), unsafe keeps 34.2% (predictive) and 36.9% (ratio) as the mean
over seeds. A verdict on this testbed says something about the paper's claim only as far as
these agree."""

from __future__ import annotations

import statistics

from pdmctl.analysis.results import AnalysisResult, Regime

ESTIMATOR = "exact"  # the primary metric's disagreement set (inference.PRIMARY_ESTIMATOR)
REALIZED = "carried"  # the step training takes: the paper's "one actual update"


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def regime_of(result: AnalysisResult) -> Regime:
    """The regime from the run's own per-seed counts (the tokens each seed's analysis counted)."""
    tokens, out = sum(result.tokens_per_seed), sum(result.out_of_region_per_seed)
    found = [c for c in result.protocol_comparisons.get(result.protocol, result.comparisons) if c.estimator == ESTIMATOR]
    per_seed = found[0].disagreement_per_seed if found else []
    realized = [c for c in result.protocol_comparisons.get(REALIZED, []) if c.estimator == ESTIMATOR]

    def pooled(stats) -> float | None:
        unsafe = sum(round(r * n) for r, n in zip(stats.unsafe_keep_per_seed, stats.kept_per_seed, strict=True)
                     if r is not None)  # fmt: skip
        return _share(unsafe, sum(stats.kept_per_seed))

    c = realized[0] if realized and realized[0].ratio.kept_per_seed else None
    return Regime(
        response_tokens=tokens,
        out_of_region=out,
        out_of_region_share=_share(out, tokens),
        estimator=ESTIMATOR,
        disagreements=sum(per_seed),
        disagreement_share=_share(sum(per_seed), out),
        disagreements_median_per_seed=float(statistics.median(per_seed)) if per_seed else None,
        disagreements_mean_per_seed=sum(per_seed) / len(per_seed) if per_seed else None,
        realized_protocol=REALIZED if c is not None else None,
        unsafe_keep_ratio=c.ratio.unsafe_keep_mean if c is not None else None,
        unsafe_keep_predictive=c.predictive.unsafe_keep_mean if c is not None else None,
        unsafe_keep_ratio_pooled=pooled(c.ratio) if c is not None else None,
        unsafe_keep_predictive_pooled=pooled(c.predictive) if c is not None else None,
    )


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}%"


REGIME_COLUMNS = ("measure", "this run", "the paper (§4.2)")


def regime_rows(regime: Regime, seeds: int) -> list[tuple[str, str, str]]:
    """The table's rows: each measure of this run with the paper's beside it."""
    n = max(seeds, 1)
    paper_share = regime.paper_disagreements_per_seed / regime.paper_out_of_region_per_seed
    median = regime.disagreements_median_per_seed
    rows = [
        ("out of the region, of the response tokens",
         f"{_pct(regime.out_of_region_share)} ({regime.out_of_region / n:,.0f} of {regime.response_tokens / n:,.0f} per seed)",
         f"a small fraction: {regime.paper_out_of_region_per_seed:,} per seed, "
         f"{regime.paper_out_of_region_per_seed / regime.paper_sequences_per_seed:.1f} per sequence of "
         f"{regime.paper_sequences_per_seed:,}"),
        (f"disagreement tokens ({regime.estimator}), of the out-of-region",
         f"{_pct(regime.disagreement_share, 2)} ({regime.disagreements / n:,.1f} per seed, median "
         f"{'—' if median is None else f'{median:g}'})",
         f"{100 * paper_share:.1f}% ({regime.paper_disagreements_per_seed} of {regime.paper_out_of_region_per_seed:,} "
         "per seed)"),
    ]  # fmt: skip
    if regime.realized_protocol is None:
        rows.append(("realized unsafe-keep, mean over seeds", "not measured (the carried protocol was not run)",
                     "about 35%"))  # fmt: skip
    else:
        rows.append((f"realized unsafe-keep ({regime.realized_protocol}), mean over seeds: predictive / ratio",
                     f"{_pct(regime.unsafe_keep_predictive)} / {_pct(regime.unsafe_keep_ratio)} (pooled "
                     f"{_pct(regime.unsafe_keep_predictive_pooled)} / {_pct(regime.unsafe_keep_ratio_pooled)})",
                     f"{_pct(regime.paper_unsafe_keep_predictive)} / {_pct(regime.paper_unsafe_keep_ratio)}"))  # fmt: skip
    return rows


def render_regime_table(result: AnalysisResult):
    from pdmctl.analysis.tables import _table

    regime = result.regime if result.regime is not None else regime_of(result)
    title = (f"The regime beside the paper's (§4.2): {len(result.seeds)} seeds of {result.model or 'this run'}; "
             "a verdict here speaks to the paper's claim only as far as these agree")  # fmt: skip
    return _table(title, REGIME_COLUMNS, 1, regime_rows(regime, len(result.seeds)))


def main(argv: list[str] | None = None) -> None:
    """`python -m pdmctl.analysis.regime RUN/analysis.json[.gz] ...`: each run's regime table (from its own
    counts where the file was written before the JSON carried it)."""
    import gzip
    import json
    import sys
    from pathlib import Path

    from rich.console import Console

    console = Console()
    for path in (sys.argv[1:] if argv is None else argv):
        raw = Path(path).read_bytes()
        result = AnalysisResult.from_dict(json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw))
        console.print(f"{path}:", highlight=False)
        console.print(render_regime_table(result))


if __name__ == "__main__":
    main()
