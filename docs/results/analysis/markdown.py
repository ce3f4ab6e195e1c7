"""The tables of `pdmctl analyze`, as Markdown, from its JSON (how docs/results/analysis.md's tables were made).

    python docs/results/analysis/markdown.py docs/results/analysis/toy-small/analysis.json.gz [OTHER.json[.gz] ...]

With several files: each one's tables, then the primary metric of each, the primary test over them (Holm over
their sign-flip p's), and the secondary comparisons of
all of them in one Holm family (as `pdmctl analyze --family`).

    python docs/results/analysis/markdown.py --verdict NAME=FILE.json [NAME=FILE.json ...]

One row per run: the primary statistic with its intervals, sign-flip p and effective seeds, and its three
channels (the results doc's verdict table; NAME labels the row).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from pdmctl.analysis.bands import BAND_COLUMNS, band_rows
from pdmctl.analysis.inference import (
    SECONDARY_COLUMNS,
    channels,
    primary_lines,
    primary_metric,
    primary_test_lines,
    secondary_family,
    secondary_rows,
)
from pdmctl.analysis.results import AnalysisResult
from pdmctl.analysis.tables import (
    ANALYSIS_COLUMNS,
    ASSUMPTION_COLUMNS,
    DECOMPOSITION_COLUMNS,
    DIFFERENCE_COLUMNS,
    PROTOCOL_COLUMNS,
    analysis_rows,
    assumption_table_rows,
    decomposition_table_rows,
    difference_rows,
    protocol_rows,
)


def table(columns, rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def paired_rows(result) -> list[tuple[str, ...]]:
    """Predictive minus ratio, per seed where both kept a disagreement token: the unsafe-keep rates' mean
    difference and its 95% t-interval, per protocol and estimator (percentage points)."""
    from pdmctl.report.stats import paired_difference

    rows = []
    for protocol, comparisons in result.protocol_comparisons.items():
        for c in comparisons:
            pairs = [(p, r) for p, r in zip(c.predictive.unsafe_keep_per_seed, c.ratio.unsafe_keep_per_seed,
                                            strict=True) if p is not None and r is not None]  # fmt: skip
            d = paired_difference([p for p, _ in pairs], [r for _, r in pairs], 0.95) if pairs else None
            mean = "—" if d is None else f"{100 * d.mean:+.1f}"
            interval = "n/a" if d is None or d.interval is None else (
                f"[{100 * d.interval.low:+.1f}, {100 * d.interval.high:+.1f}]")  # fmt: skip
            rows.append((protocol, c.estimator, mean, interval, str(len(pairs))))
    return rows


def tables(result: AnalysisResult) -> None:
    n = len(result.seeds)
    print(f"{n} seeds {result.seeds[0]}-{result.seeds[-1]}, {result.divergence} δ={result.delta} K={result.k} "
          f"{result.precision}, setting {result.setting}, main protocol {result.protocol}; per seed "
          f"{sum(result.out_of_region_per_seed) / n:.0f} of {sum(result.tokens_per_seed) / n:.0f} response tokens "
          "out of the region\n")  # fmt: skip
    for title, columns, rows in (
        ("Main table", ANALYSIS_COLUMNS, analysis_rows(result)),
        ("Estimators compared", DIFFERENCE_COLUMNS, difference_rows(result)),
        ("Predictive minus ratio, unsafe-keep rate, paired by seed",
         ("protocol", "estimator", "mean difference (points)", "95% t-interval", "seeds"), paired_rows(result)),
        ("Per protocol", PROTOCOL_COLUMNS, protocol_rows(result)),
        ("Decomposition", DECOMPOSITION_COLUMNS, decomposition_table_rows(result)),
        ("Logit-space assumption", ASSUMPTION_COLUMNS, assumption_table_rows(result)),
        ("Bands", BAND_COLUMNS, band_rows(result.bands)),
    ):
        print(f"### {title}\n\n{table(columns, rows)}\n")


def _pts(x: float) -> str:
    return "n/a" if x != x else f"{100 * x:+.1f}"


def verdict(named: list[str]) -> None:
    """One row per run: `markdown.py --verdict NAME=FILE ...` (module docstring)."""
    from pdmctl.report.stats import format_p

    columns = ["run", "out of region / seed", "kept (predictive / ratio)", "of them below the sign floor",
               "primary, pooled [95% bootstrap]",
               "sign-flip p", "effective seeds", "per-seed mean [95% t]", "clip held", "own step, first order"]
    rows = []
    for item in named:
        name, _, path = item.partition("=")
        result = load(path)
        m = primary_metric(result)
        by = {c.name: c for c in channels(result)}

        def channel(key: str, by: dict = by) -> str:
            c = by.get(key)
            return "n/a" if c is None else f"{_pts(c.pooled)} [{_pts(c.low)}, {_pts(c.high)}], p {format_p(c.p)}"

        out = sum(result.out_of_region_per_seed) / len(result.seeds)
        below = {c.criterion: sum(c.below_floor) for c in result.counterfactual
                 if (c.estimator, c.tokens, c.decision) == ("exact", "disagreement", "kept") and c.below_floor}  # fmt: skip
        rows.append([name, f"{out:,.0f}", f"{m.kept_predictive:,} / {m.kept_ratio:,}",
                     f"{below.get('predictive', 0):,} / {below.get('ratio', 0):,}" if below else "n/a",
                     f"**{_pts(m.pooled)}** [{_pts(m.low)}, {_pts(m.high)}]", format_p(m.p), f"{m.effective_seeds:.1f}",
                     f"{_pts(m.per_seed_mean)} [{_pts(m.t_low)}, {_pts(m.t_high)}] ({m.seeds_compared} seeds)",
                     channel("clip held"), channel("own step, first order")])  # fmt: skip
    print(table(columns, rows))


def load(path: str) -> AnalysisResult:
    """An `analyze --json` file, plain or gzipped (`.json.gz`, as the results directory keeps them)."""
    raw = Path(path).read_bytes()
    return AnalysisResult.from_dict(json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw))


def main(paths: list[str]) -> None:
    results = [load(path) for path in paths]
    for result in results:
        tables(result)
    print("### Primary metric\n\n```")
    metrics = [primary_metric(result) for result in results]
    for metric in metrics:
        print("\n".join(primary_lines(metric)))
    print("\n".join(primary_test_lines(metrics)))
    print("```\n")
    family = secondary_family(results)
    print(f"### Secondary comparisons, one Holm family ({sum(1 for s in family if s.p == s.p)} tests)\n")
    print(table(SECONDARY_COLUMNS, secondary_rows(family)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--verdict"]:
        verdict(sys.argv[2:])
    else:
        main(sys.argv[1:])
