"""Write a `Report` out: Markdown, CSV, LaTeX, figures (PNG, and SVG beside each of the report's own) and one
self-contained HTML page."""

from __future__ import annotations

import base64
import datetime as dt
import re
from dataclasses import dataclass
from pathlib import Path

from pdmctl.report import plots
from pdmctl.report.intervals import short_name
from pdmctl.report.model import Report, SettingCurves
from pdmctl.report.page import header, render
from pdmctl.report.tables import (
    TextTable,
    comparison_csv,
    comparison_table,
    cost_table,
    direction_table,
    excluded_table,
    methods,
    pass_k_csv,
    pass_k_table,
    power_table,
    provenance_table,
    results_csv,
    results_table,
    seeds_csv,
    tex,
    to_html,
    to_latex,
    to_markdown,
)


@dataclass(frozen=True)
class FigureFile:
    name: str  # the PNG's file name under figures/
    caption: str
    png: bytes
    svg: bytes | None = None  # the same figure as SVG, beside the PNG (the direction analysis draws PNG only)

    @property
    def svg_name(self) -> str | None:
        return None if self.svg is None else self.name.removesuffix(".png") + ".svg"


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
    if any(not isinstance(c, str) for c in report.cost):
        out.append(cost_table(report))
    return [*out, excluded_table(report)]


def figures(report: Report) -> list[FigureFile]:
    """Each setting's figures; their captions say what is drawn, the Methods block how the bands are made."""
    out = []
    band = f"{short_name(report.definition.confidence.for_bands)} band"
    kinds = report.definition.panels
    for curves in report.curves:
        note = _selection_note(curves)
        if "eval" in kinds:
            sets = ", ".join(report.name(label) for label in curves.eval_panels)
            out.append(FigureFile(f"curves_{slug(curves.setting)}.png",
                                  f"{curves.setting}: held-out avg@16 ({sets}) against step; line = mean over "
                                  f"seeds, band = {band} (Methods).{note}",
                                  *plots.curve_figure(curves, band, report.names)))  # fmt: skip
        if curves.mismatch_panels and "mismatch" in kinds:
            metrics = "; ".join(f"{label}: {', '.join(names)}" for label, names in curves.mismatch_metrics.items()
                                if label in curves.mismatch_panels)  # fmt: skip
            out.append(FigureFile(f"mismatch_{slug(curves.setting)}.png",
                                  f"{curves.setting}: the rollout/trainer mismatch over training, per mask and "
                                  f"setting ({metrics}; each run's first of the panel's metrics that it logged); "
                                  f"line = mean over seeds, band = {band} (Methods).{note}",
                                  *plots.mismatch_figure(curves, band)))  # fmt: skip
        if curves.dynamics_panels and "dynamics" in kinds:
            out.append(FigureFile(f"dynamics_{slug(curves.setting)}.png",
                                  f"{curves.setting}: training dynamics ({', '.join(curves.dynamics_panels)}); "
                                  f"line = mean over seeds, band = {band} (Methods).{note}",
                                  *plots.dynamics_figure(curves, band)))  # fmt: skip
    if report.analysis is not None and report.analysis.get("disagreement_tokens"):  # analyses before: no data
        from pdmctl.analysis.figures import render as render_analysis
        from pdmctl.analysis.results import AnalysisResult

        result = AnalysisResult.from_dict(report.analysis)
        out += [FigureFile(f"direction_{name}", caption, png) for name, caption, png in render_analysis(result)]
    return out


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
        if fig.svg is not None:
            put(f"figures/{fig.svg_name}", fig.svg)
    put("results.csv", results_csv(report))
    put("seeds.csv", seeds_csv(report))
    put("comparison.csv", comparison_csv(report))
    if report.pass_k:
        put("passk.csv", pass_k_csv(report))
    put("results.md", markdown_page(report, grids, figs))
    put("results.tex", latex_tables(report, grids))
    put("index.html", html_page(report, grids, figs))
    return written


def _header(report: Report) -> tuple[str, str]:
    d = report.definition
    title = f"pdmctl report: {', '.join(report.sweeps)}"
    meta = (f"definition {d.name}; values {d.at.describe()}; baseline {d.baseline}; "
            f"{sum(len(r.seeds) for r in report.rows)} runs counted, {len(report.excluded)} left out")  # fmt: skip
    return title, meta


def _generated() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _provenance_line(report: Report) -> str:
    h = header(report.tracking_uri)
    return f"pdmctl {h['version']} · commit {h['commit']} · store {h['store']} · generated {_generated()}"


def markdown_page(report: Report, grids: list[TextTable], figs: list[FigureFile]) -> str:
    title, meta = _header(report)
    parts = [f"# {title}", "", _provenance_line(report), "", meta, ""]
    parts += [to_markdown(t) for t in grids]
    parts += [f"![{fig.caption}](figures/{fig.name})\n\n*{fig.caption}*"
              + (f" [SVG](figures/{fig.svg_name})" if fig.svg_name else "") + "\n" for fig in figs]  # fmt: skip
    parts += ["## Methods", "", *(f"{p}\n" for p in methods(report))]
    return "\n".join(parts)


def latex_tables(report: Report, grids: list[TextTable]) -> str:
    """Every table (booktabs), after a Methods paragraph that their notes refer to; each value and its interval
    in one column (`35.0 [22.6, 47.4]`), one column per held-out set."""
    head = [f"% {tex(_provenance_line(report))}", r"\paragraph{Methods}", *(tex(p) + "\n" for p in methods(report))]
    interval = f"{100 * report.definition.confidence.level:g}% CI"
    return "\n".join([*head, *(to_latex(t, interval) for t in grids)])


def figure_links(fig: FigureFile) -> dict[str, str | None]:
    """A figure as the page shows it: the PNG embedded, and the paths of its PNG and SVG files beside the page."""
    return {"data": base64.b64encode(fig.png).decode("ascii"), "caption": fig.caption, "png": f"figures/{fig.name}",
            "svg": f"figures/{fig.svg_name}" if fig.svg_name else None}  # fmt: skip


def html_page(report: Report, grids: list[TextTable], figs: list[FigureFile]) -> str:
    """One file, nothing fetched: the figures are embedded as base64 data URIs (templates/report.html.j2),
    each with links to its PNG and SVG files beside the page."""
    title, meta = _header(report)
    by_key = {t.key: t for t in grids}
    sections = [
        ("Results", ["results"]),
        ("Against the baseline", ["comparison", "power"]),
        ("pass@k and maj@k", ["passk"]),
        ("Direction analysis", ["direction"]),
    ]
    present = [(heading, [to_html(by_key[k]) for k in keys if k in by_key]) for heading, keys in sections]
    excluded = by_key["excluded"]
    return render(
        "report.html.j2",
        title=title,
        header=header(report.tracking_uri),
        generated=_generated(),
        meta=meta,
        sections=[(heading, tables) for heading, tables in present if tables],
        figures=[figure_links(f) for f in figs],
        methods=methods(report),
        provenance=to_html(by_key["provenance"]) if "provenance" in by_key else None,
        cost=to_html(by_key["cost"]) if "cost" in by_key else None,
        excluded=to_html(excluded) if excluded.rows else None,
        excluded_note=excluded.note,
    )


def log_to_sweep_run(ledger, sweeps: list[str], out_dir: Path, written: list[Path]) -> str:
    """The report's files as artifacts of its sweep's parent run in MLflow (`report/`); the line that says
    where they went, or why not: a report of several sweeps has no one parent run, and a store that refuses
    (another login's sweep, an artifact store out of reach) leaves the files on disk only."""
    from pdmctl.ledger import LedgerError

    if len(sweeps) != 1:
        return (f"MLflow: not logged: the report spans {len(sweeps)} sweeps and a sweep's parent run holds a "
                "report of that sweep alone")  # fmt: skip
    try:
        run_id = ledger.log_report(sweeps[0], written, out_dir)
    except LedgerError as exc:
        return f"MLflow: not logged ({exc})"
    return f"MLflow: {len(written)} files logged to run {run_id}, the parent run of sweep {sweeps[0]} (report/)"
