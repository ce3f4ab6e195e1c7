"""The paper's token-level figures (§4.2, Figs 3-4) from a direction analysis (analysis.AnalysisResult).

    python -m pdmctl.analysis.figures analysis.json DIR    # from `pdmctl analyze --json`
    pdmctl analyze --seeds 61 --figures DIR                    # the same, from the run itself

Four PNGs, each from the result's own numbers (nothing is recomputed):

- `delta_d_cdf.png` (Fig. 4a): the empirical CDF of ΔD over the kept disagreement tokens, the ratio
  criterion's against the predictive one's, one panel per tail estimator, under the main protocol;
  the height of each curve at ΔD = 0 is the share of corrective keeps, the rest are unsafe keeps.
- `seed_pairs.png` (Fig. 3b): one point per seed, its unsafe-keep rate under the ratio criterion (x)
  against the predictive one (y); below the diagonal the predictive criterion wins that seed.
- `disagreements.png`: disagreement tokens per seed (every one has A ≠ 0: at A = 0 both criteria
  keep), per estimator, beside the out-of-region tokens per seed.
- `positions.png`: per response position, the share of tokens out of the region, the disagreement
  tokens, and the unsafe-keep rate of each criterion (estimator `exact`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pdmctl.analysis.results import ESTIMATORS, AnalysisResult, DisagreementTokens

FIGURES = ("delta_d_cdf", "seed_pairs", "disagreements", "positions")
COLORS = {"ratio": "tab:red", "predictive": "tab:blue"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _kept(tokens: DisagreementTokens, protocol: str, predictive: bool) -> list[float]:
    return [d for d, p in zip(tokens.delta_d[protocol], tokens.predictive_keeps, strict=True) if p == predictive]


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _title(result: AnalysisResult) -> str:
    setting = ", mismatch only" if result.setting == "mismatch-only" else ""
    return (
        f"{len(result.seeds)} seeds, {result.divergence} δ={result.delta} K={result.k} {result.precision}"
        f"{setting}; ΔD after a {result.protocol} update"
    )


def _symlog(ax, linthresh: float) -> None:
    """A symmetric log x-axis, linear within ±linthresh; the labels at ±linthresh left out (they crowd 0)."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("symlog", linthresh=linthresh)
    label = ax.xaxis.get_major_formatter()
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, pos: "" if 0 < abs(x) <= 1.0001 * linthresh else label(x, pos)))


def delta_d_cdf(result: AnalysisResult):
    """Fig. 4a: the CDF of ΔD of the kept disagreement tokens; per estimator, line 0 ratio, line 1 predictive."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(result.disagreement_tokens), figsize=(5 * len(ESTIMATORS), 4), squeeze=False)
    for ax, tokens in zip(axes[0], result.disagreement_tokens, strict=True):
        scale = 0.0
        for name, predictive in (("ratio", False), ("predictive", True)):
            values = _kept(tokens, result.protocol, predictive)
            xs, ys = _cdf(values)
            unsafe = sum(v > 0 for v in values) / len(values) if values else float("nan")
            ax.step(xs, ys, where="post", color=COLORS[name],
                    label=f"{name} keeps ({len(values)} tokens, pooled: {100 * unsafe:.1f}% ΔD > 0)")  # fmt: skip
            scale = max([scale, *(abs(v) for v in values)])
        ax.axvline(0.0, color="grey", linewidth=0.8)
        if scale > 0:
            _symlog(ax, scale * 1e-3)
        ax.set_xlabel("ΔD of the kept disagreement token")
        ax.set_ylabel("cumulative share")
        ax.set_title(f"estimator {tokens.estimator}")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("ΔD on the disagreement tokens (Fig. 4a): " + _title(result), fontsize=9)
    fig.tight_layout()
    return fig


def seed_pairs(result: AnalysisResult):
    """Fig. 3b: per estimator, one point per seed with both rates: (ratio, predictive) unsafe-keep rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(result.comparisons), figsize=(4.2 * len(result.comparisons), 4), squeeze=False)
    for ax, c in zip(axes[0], result.comparisons, strict=True):
        pairs = [(r, p) for r, p in zip(c.ratio.unsafe_keep_per_seed, c.predictive.unsafe_keep_per_seed,
                                         strict=True) if r is not None and p is not None]  # fmt: skip
        ax.scatter([r for r, _ in pairs], [p for _, p in pairs], s=14, color=COLORS["predictive"])
        ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8)
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("unsafe-keep rate, ratio criterion")
        ax.set_ylabel("unsafe-keep rate, predictive criterion")
        ax.set_title(f"{c.estimator}: predictive wins {c.predictive_wins}, ratio {c.ratio_wins} of {c.seeds_compared}",
                     fontsize=9)  # fmt: skip
    fig.suptitle("Per-seed unsafe-keep rates (Fig. 3b): " + _title(result), fontsize=9)
    fig.tight_layout()
    return fig


def disagreements(result: AnalysisResult):
    """Per seed: the out-of-region tokens (bars, left) and each estimator's disagreement tokens (lines)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    seeds = list(range(len(result.seeds)))
    ax.bar(seeds, result.out_of_region_per_seed, color="lightgrey", label="out of the region")
    for c in result.comparisons:
        ax.plot(seeds, c.disagreement_per_seed, marker="o", markersize=3, label=f"disagreements, {c.estimator}")
    ax.set_xlabel(f"seed (index; seeds {result.seeds[0]}..{result.seeds[-1]})" if result.seeds else "seed")
    ax.set_ylabel("tokens")
    ax.set_yscale("symlog", linthresh=10)
    ax.legend(fontsize=8)
    ax.set_title("Out-of-region and disagreement tokens per seed (every disagreement has A ≠ 0): "
                 + _title(result), fontsize=9)  # fmt: skip
    fig.tight_layout()
    return fig


def position_stats(result: AnalysisResult, estimator: str = "exact") -> dict[str, list[float | None]]:
    """Per response position: the out-of-region share, the disagreement tokens and each criterion's
    unsafe-keep rate (None where it kept none) under the main protocol."""
    tokens = next(t for t in result.disagreement_tokens if t.estimator == estimator)
    n = len(result.tokens_per_position)
    found: dict[str, list[float | None]] = {
        "out_of_region_share": [o / t if t else None for o, t in
                                zip(result.out_of_region_per_position, result.tokens_per_position, strict=True)],
        "disagreements": [float(tokens.position.count(i)) for i in range(n)],
    }  # fmt: skip
    for name, predictive in (("ratio", False), ("predictive", True)):
        rates: list[float | None] = []
        for i in range(n):
            kept = [d for d, p, k in zip(tokens.delta_d[result.protocol], tokens.position, tokens.predictive_keeps,
                                         strict=True) if p == i and k == predictive]  # fmt: skip
            rates.append(sum(d > 0 for d in kept) / len(kept) if kept else None)
        found[f"unsafe_keep_{name}"] = rates
    return found


def positions(result: AnalysisResult, estimator: str = "exact"):
    plt = _pyplot()
    stats = position_stats(result, estimator)
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    xs = list(range(len(result.tokens_per_position)))

    def points(values):
        return [x for x, v in zip(xs, values, strict=True) if v is not None], [v for v in values if v is not None]

    top.plot(*points(stats["out_of_region_share"]), marker="o", color="black")
    top.set_ylabel("share out of region")
    mid.bar(xs, stats["disagreements"], color="grey")
    mid.set_ylabel(f"disagreements ({estimator})")
    for name in ("ratio", "predictive"):
        low.plot(*points(stats[f"unsafe_keep_{name}"]), marker="o", color=COLORS[name], label=name)
    low.set_ylim(-0.02, 1.02)
    low.set_ylabel("unsafe-keep rate")
    low.set_xlabel("response position")
    low.legend(fontsize=8)
    top.set_title("Per response position: " + _title(result), fontsize=9)
    fig.tight_layout()
    return fig


CAPTIONS = {
    "delta_d_cdf": "Direction analysis (Fig. 4a): the CDF of ΔD over the kept disagreement tokens, ratio vs "
    "predictive criterion, per tail estimator; the height at ΔD = 0 is the corrective share",
    "seed_pairs": "Direction analysis (Fig. 3b): each seed's unsafe-keep rate, ratio (x) vs predictive (y); below "
    "the diagonal the predictive criterion wins the seed",
    "disagreements": "Direction analysis: out-of-region and disagreement tokens per seed (all with A ≠ 0)",
    "positions": "Direction analysis: per response position, the out-of-region share, the disagreement tokens and "
    "each criterion's unsafe-keep rate (estimator exact)",
}


def render(result: AnalysisResult) -> list[tuple[str, str, bytes]]:
    """The four figures as (file name, caption, PNG bytes)."""
    import io

    plt = _pyplot()
    found = []
    for name, make in zip(FIGURES, (delta_d_cdf, seed_pairs, disagreements, positions), strict=True):
        fig = make(result)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110)
        plt.close(fig)
        found.append((f"{name}.png", CAPTIONS[name], buffer.getvalue()))
    return found


def write_figures(result: AnalysisResult, directory: Path) -> list[Path]:
    """The four PNGs of the module's docstring, written into `directory` (created); their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, _, png in render(result):
        (directory / name).write_bytes(png)
        written.append(directory / name)
    return written


def main(argv: list[str]) -> None:
    import json

    from pdmctl.analysis.results import AnalysisResult

    if len(argv) != 2:
        raise SystemExit("usage: python -m pdmctl.analysis.figures ANALYSIS.json DIR")
    result = AnalysisResult.from_dict(json.loads(Path(argv[0]).read_text()))
    if not result.disagreement_tokens:
        raise SystemExit(f"{argv[0]}: written before the figures' data (no disagreement_tokens); run analyze again")
    for path in write_figures(result, Path(argv[1])):
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
