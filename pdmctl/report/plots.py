"""Figures: per setting, the eval learning curves and the training-dynamics panels, each drawn once and
saved twice: PNG for the page, SVG (vector, for a paper) beside it.

One figure of each kind per setting keeps the count bounded however large the sweep. Matplotlib's
object-oriented API (no pyplot): no global state, no display backend.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pdmctl.report.collect import RowKey
from pdmctl.report.model import Line, SettingCurves

PANEL_SIZE = (4.0, 3.0)
DPI = 90

Drawn = tuple[bytes, bytes]  # the same figure as PNG and as SVG


def save(fig: Figure) -> Drawn:
    """PNG and SVG of `fig`; the SVG the same bytes for the same figure (no date, fixed element ids)."""
    png, svg = io.BytesIO(), io.BytesIO()
    fig.savefig(png, format="png", dpi=DPI)
    with rc_context({"svg.hashsalt": "pdmctl"}):
        fig.savefig(svg, format="svg", metadata={"Date": None})
    return png.getvalue(), svg.getvalue()


def colours(rows: Sequence[RowKey]) -> dict[RowKey, tuple[float, ...]]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(rows) <= 10 else "tab20"]
    return {row: cmap(i % cmap.N) for i, row in enumerate(rows)}


def _panels(title: str, panels: Mapping[str, list[Line]], colour: Mapping[RowKey, tuple[float, ...]],
            scale: float, ylabel: str) -> Drawn:  # fmt: skip
    n = max(len(panels), 1)
    n_lines = max((len(lines) for lines in panels.values()), default=0)
    legend_rows = -(-n_lines // 4)
    height = PANEL_SIZE[1] + 0.25 * legend_rows
    fig = Figure(figsize=(PANEL_SIZE[0] * n, height))
    # a fixed layout: constrained/tight layout would double the drawing time of a figure
    fig.subplots_adjust(left=0.5 / (PANEL_SIZE[0] * n) + 0.03, right=0.99, wspace=0.3, top=1 - 0.55 / height,
                        bottom=(0.55 + 0.25 * legend_rows) / height)  # fmt: skip
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (label, lines) in zip(axes, panels.items(), strict=False):
        for ln in lines:
            c = colour[ln.row]
            ax.plot(ln.steps, scale * ln.centre, color=c, lw=1.6, label=f"{ln.row.label} (n={ln.n_seeds})")
            band = np.isfinite(ln.low) & np.isfinite(ln.high)
            if band.any():
                ax.fill_between(
                    ln.steps, scale * ln.low, scale * ln.high, where=band, color=c, alpha=0.2, lw=0
                )
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel if scale != 1 else label)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, names = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(
            handles, names, loc="lower center", ncols=min(len(names), 4), fontsize="small", frameon=False
        )
    fig.suptitle(title)
    return save(fig)


def curve_figure(curves: SettingCurves, band: str, names: Mapping[str, str] | None = None) -> Drawn:
    """`band` names the interval drawn around each line (e.g. `95% t band`); it goes into the title.
    `names`: a column label -> the held-out set shown for it (the panel's title)."""
    title = f"{curves.setting}: held-out avg@16, mean over seeds and {band}"
    panels = {(names or {}).get(label, label): lines for label, lines in curves.eval_panels.items()}
    return _panels(title, panels, colours(curves.rows), 100.0, "avg@16 (%)")


def dynamics_figure(curves: SettingCurves, band: str) -> Drawn:
    title = f"{curves.setting}: training dynamics, mean over seeds and {band}"
    return _panels(title, curves.dynamics_panels, colours(curves.rows), 1.0, "")


def mismatch_figure(curves: SettingCurves, band: str) -> Drawn:
    title = f"{curves.setting}: rollout/trainer mismatch, mean over seeds and {band}"
    return _panels(title, curves.mismatch_panels, colours(curves.rows), 1.0, "")
