"""Write a `Report` out: Markdown, CSV, LaTeX, PNG figures and one self-contained HTML page."""

from __future__ import annotations

import base64
import datetime as dt
import html
import re
from dataclasses import dataclass
from pathlib import Path

from pdmctl.report import plots
from pdmctl.report.build import Report, SettingCurves
from pdmctl.report.intervals import describe, short_name
from pdmctl.report.tables import (
    TextTable,
    comparison_csv,
    comparison_table,
    direction_table,
    excluded_table,
    pass_k_csv,
    pass_k_table,
    power_table,
    provenance_table,
    results_csv,
    results_table,
    seeds_csv,
    to_html,
    to_latex,
    to_markdown,
)

_CSS = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:1200px;padding:0 1rem;color:#222}
table{border-collapse:collapse;margin:1rem 0 .3rem;font-size:.9rem}
caption{text-align:left;font-weight:600;padding:.3rem 0}
th,td{padding:.25rem .6rem;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap}
th{border-bottom:2px solid #444}.num{text-align:right;font-variant-numeric:tabular-nums}
.note{font-size:.85rem;color:#555;max-width:1100px}figure{margin:1rem 0}img{max-width:100%}
.meta{color:#555;font-size:.85rem}
"""


@dataclass(frozen=True)
class FigureFile:
    name: str  # file name under figures/
    caption: str
    png: bytes


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "all"


def tables(report: Report) -> list[TextTable]:
    out = [results_table(report), comparison_table(report)]
    if report.comparisons:
        out.append(power_table(report))
    if report.pass_k:
        out.append(pass_k_table(report))
    if report.analysis is not None:
        out.append(direction_table(report.analysis))
    if report.provenance:
        out.append(provenance_table(report))
    return [*out, excluded_table(report)]


def figures(report: Report) -> list[FigureFile]:
    out = []
    band = f"{short_name(report.definition.confidence.for_bands)} band"
    kinds = report.definition.panels
    for curves in report.curves:
        note = _selection_note(curves)
        if "eval" in kinds:
            out.append(FigureFile(f"curves_{slug(curves.setting)}.png",
                              f"{curves.setting}: held-out avg@16 against step; line = mean over seeds, band = "
                              f"{_band_note(report)}.{note}", plots.curve_figure(curves, band)))  # fmt: skip
        if curves.mismatch_panels and "mismatch" in kinds:
            metrics = "; ".join(f"{label}: {', '.join(names)}" for label, names in curves.mismatch_metrics.items())
            out.append(FigureFile(f"mismatch_{slug(curves.setting)}.png",
                              f"{curves.setting}: the rollout/trainer mismatch over training, per mask and setting "
                              f"({metrics}; each run's first of the panel's metrics that it logged); line = mean "
                              f"over seeds, band = {_band_note(report)}.{note}",
                              plots.mismatch_figure(curves, band)))  # fmt: skip
        if curves.dynamics_panels and "dynamics" in kinds:
            out.append(FigureFile(f"dynamics_{slug(curves.setting)}.png",
                              f"{curves.setting}: training dynamics "
                              f"({', '.join(curves.dynamics_panels)}); line = mean over seeds, band = "
                              f"{_band_note(report)}.{note}", plots.dynamics_figure(curves, band)))  # fmt: skip
    if report.analysis is not None and report.analysis.get("disagreement_tokens"):  # analyses before: no data
        from pdmctl.analysis.figures import render
        from pdmctl.analysis.results import AnalysisResult

        result = AnalysisResult.from_dict(report.analysis)
        out += [FigureFile(f"direction_{name}", caption, png) for name, caption, png in render(result)]
    return out


def _band_note(report: Report) -> str:
    return f"the {describe(report.definition.confidence.for_bands)}, at each step; no band with one seed"


def _selection_note(curves: SettingCurves) -> str:
    if not curves.chosen_by_best:
        return ""
    return " More rows than one figure holds: each mask at its best row by the table's average."


def write_report(report: Report, out_dir: Path) -> list[Path]:
    """Every output file; returns their paths (index.html last)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "figures").mkdir(exist_ok=True)
    grids = tables(report)
    figs = figures(report)
    written = []

    def put(name: str, content: str | bytes) -> None:
        path = out_dir / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        written.append(path)

    for fig in figs:
        put(f"figures/{fig.name}", fig.png)
    put("results.csv", results_csv(report))
    put("seeds.csv", seeds_csv(report))
    put("comparison.csv", comparison_csv(report))
    if report.pass_k:
        put("passk.csv", pass_k_csv(report))
    put("results.md", markdown_page(report, grids, figs))
    put("results.tex", "\n".join(to_latex(t) for t in grids))
    put("index.html", html_page(report, grids, figs))
    return written


def _header(report: Report) -> tuple[str, str]:
    d = report.definition
    title = f"pdmctl report: {', '.join(report.sweeps)}"
    meta = (f"definition {d.name}; values {d.at.describe()}; baseline {d.baseline}; tracking {report.tracking_uri}; "
            f"{sum(len(r.seeds) for r in report.rows)} runs counted, {len(report.excluded)} left out; "
            f"generated {dt.datetime.now().isoformat(timespec='seconds')}")  # fmt: skip
    return title, meta


def markdown_page(report: Report, grids: list[TextTable], figs: list[FigureFile]) -> str:
    title, meta = _header(report)
    parts = [f"# {title}", "", meta, ""]
    parts += [to_markdown(t) for t in grids]
    parts += [f"![{fig.caption}](figures/{fig.name})\n\n*{fig.caption}*\n" for fig in figs]
    return "\n".join(parts)


def html_page(report: Report, grids: list[TextTable], figs: list[FigureFile]) -> str:
    """One file, nothing fetched: the figures are embedded as base64 data URIs."""
    title, meta = _header(report)
    body = [f"<h1>{html.escape(title)}</h1>", f'<p class="meta">{html.escape(meta)}</p>']
    by_key = {t.key: t for t in grids}
    sections = [
        ("Results", ["results"]),
        ("Against the baseline", ["comparison", "power"]),
        ("pass@k and maj@k", ["passk"]),
        ("Direction analysis", ["direction"]),
    ]
    for heading, keys in sections:
        present = [by_key[k] for k in keys if k in by_key]
        if present:
            body.append(f"<h2>{heading}</h2>")
            body += [to_html(t) for t in present]
    if figs:
        body.append("<h2>Learning curves, the rollout/trainer mismatch and training dynamics</h2>")
    for fig in figs:
        data = base64.b64encode(fig.png).decode("ascii")
        body.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(fig.caption)}">'
                    f"<figcaption class=note>{html.escape(fig.caption)}</figcaption></figure>")  # fmt: skip
    if "provenance" in by_key:
        body += ["<h2>Provenance</h2>", to_html(by_key["provenance"])]
    excluded = by_key["excluded"]
    body += [
        "<h2>Left out</h2>",
        to_html(excluded) if excluded.rows else f'<p class="note">{html.escape(excluded.note)}</p>',
    ]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")  # fmt: skip
