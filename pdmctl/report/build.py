"""The report as data: tables of estimates, comparisons with the baseline, curves with seed bands.

`build_report` reads the ledger (a few bulk statements) and returns a `Report`; `pdmctl.report.write`
turns it into files. Nothing here draws or formats.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdmctl.ledger import Ledger, load_per_problem
from pdmctl.report import intervals, resample
from pdmctl.report.collect import Collected, Exclusion, RowKey, RunPoint, collect
from pdmctl.report.definition import Definition, ReportError
from pdmctl.report.stats import (
    Comparison,
    Estimate,
    Series,
    holm,
    mean,
    paired_p_value,
    probability_of_improvement_paired,
    welch_p_value,
)


@dataclass(frozen=True)
class TableRow:
    row: RowKey
    seeds: tuple[int, ...]
    cells: dict[str, Estimate]  # column label (and the average's) -> mean over seeds with its interval
    two_level: dict[str, bool] = field(default_factory=dict)  # column label -> seeds and problems resampled
    per_seed: dict[str, tuple[float, ...]] = field(default_factory=dict)  # column label -> the value of each seed


@dataclass(frozen=True)
class ComparisonRow:
    row: RowKey
    baseline: RowKey
    seeds: tuple[int, ...]  # the matched seeds; empty when unpaired
    cells: dict[str, Comparison]


@dataclass(frozen=True)
class Line:
    """One row's curve on one panel: mean over seeds and its band at every step."""

    row: RowKey
    steps: np.ndarray
    centre: np.ndarray
    low: np.ndarray  # NaN where there is no band (one seed)
    high: np.ndarray
    n_seeds: int


@dataclass(frozen=True)
class SettingCurves:
    setting: str
    rows: list[RowKey]
    chosen_by_best: bool  # more rows than a figure holds: each mask at its best row by the average
    eval_panels: dict[str, list[Line]]  # panel label -> lines
    dynamics_panels: dict[str, list[Line]]


@dataclass(frozen=True)
class Report:
    sweeps: tuple[str, ...]
    tracking_uri: str
    definition: Definition
    dims: tuple[str, ...]
    labels: tuple[str, ...]  # value columns: the definition's, then the average
    rows: list[TableRow]
    comparisons: list[ComparisonRow]
    excluded: list[Exclusion]
    curves: list[SettingCurves]
    two_level: bool
    baseline_present: bool
    analysis: dict | None = None  # the direction analysis (AnalysisResult as JSON), when given
    queries: int = 0  # statements the ledger sent to the store for this report


def build_report(ledger: Ledger, sweeps: Sequence[str], definition: Definition, *, two_level: bool = False,
                 analysis: Path | None = None) -> Report:  # fmt: skip
    direction = load_analysis(analysis) if analysis else None  # a wrong path fails before any work
    queries_before = getattr(ledger, "queries", 0)
    data = collect(ledger, sweeps, definition)
    labels = tuple(c.label for c in definition.columns) + (
        (definition.average,) if definition.average else ()
    )
    rows = table_rows(data, definition, labels)
    if two_level:
        rows = [with_two_level(row, data.by_row[row.row], ledger.uri, definition) for row in rows]
    return Report(
        sweeps=tuple(sweeps),
        tracking_uri=ledger.uri,
        definition=definition,
        dims=data.dims,
        labels=labels,
        rows=rows,
        comparisons=comparisons(data, definition, labels),
        excluded=data.excluded,
        curves=curves(ledger, data, definition, rows),
        two_level=two_level,
        baseline_present=any(r.mask == definition.baseline for r in data.rows),
        analysis=direction,
        queries=getattr(ledger, "queries", 0) - queries_before,
    )


def _run_values(point: RunPoint, labels: Sequence[str], average: str | None) -> dict[str, float]:
    values = dict(point.values)
    if average:
        values[average] = mean([point.values[label] for label in labels if label != average])
    return values


def table_rows(data: Collected, definition: Definition, labels: Sequence[str]) -> list[TableRow]:
    """Every row of the report with its mean and seed interval per column (one batch per size)."""
    samples = []
    for row in data.rows:
        values = [_run_values(p, labels, definition.average) for p in data.by_row[row]]
        samples += [[v[label] for v in values] for label in labels]
    estimates = iter(intervals.seed_intervals(samples, definition.confidence))
    per_seed = iter(samples)
    return [TableRow(row, tuple(p.seed for p in data.by_row[row]), {label: next(estimates) for label in labels},
                     per_seed={label: tuple(next(per_seed)) for label in labels})
            for row in data.rows]  # fmt: skip


def with_two_level(row: TableRow, points: list[RunPoint], uri: str, definition: Definition) -> TableRow:
    """The row's intervals from a bootstrap over seeds and problems, for each column whose every run logged
    per-problem scores at the evaluation steps it was read at (with the same number of problems)."""
    per_column: dict[str, np.ndarray] = {}
    for column in definition.columns:
        matrix = _per_problem(points, column.label, uri)
        if matrix is not None:
            per_column[column.label] = matrix
    cells, flags = dict(row.cells), {}
    for label in row.cells:
        parts = list(per_column.values()) if label == definition.average else [per_column.get(label)]
        complete = label != definition.average or len(per_column) == len(definition.columns)
        if complete and parts and all(p is not None for p in parts):
            estimate = resample.two_level_interval(parts, definition.confidence)
            cells[label] = Estimate(row.cells[label].mean, estimate.n, estimate.interval)
            flags[label] = True
    return TableRow(row.row, row.seeds, cells, flags, row.per_seed)


def _per_problem(points: list[RunPoint], label: str, uri: str) -> np.ndarray | None:
    rows = []
    for p in points:
        dataset = p.metrics[label].removeprefix("eval/")
        by_step = load_per_problem(uri, p.run_id, dataset)
        if not all(s in by_step for s in p.steps):
            return None
        scores = [by_step[s] for s in p.steps]
        if len({len(s) for s in scores}) != 1:
            return None
        rows.append(np.mean(scores, axis=0))
    if not rows or len({len(r) for r in rows}) != 1:
        return None
    return np.array(rows, dtype=float)


def baseline_row(row: RowKey, candidates: Sequence[RowKey], baseline: str) -> RowKey | None:
    """The baseline's row to compare `row` with: same setting, and the same δ, K, ... wherever the baseline
    has that value (GRPO rows have no δ; a baseline run at one δ serves every δ of a swept mask)."""
    pool = [c for c in candidates if c.setting == row.setting and c.mask == baseline]
    for label, value in row.dims:
        narrowed = [c for c in pool if c.dim(label) == value]
        if narrowed:
            pool = narrowed
    return pool[0] if len(pool) == 1 else None


def comparisons(data: Collected, definition: Definition, labels: Sequence[str]) -> list[ComparisonRow]:
    """Each mask's rows against the baseline's: paired on the seeds both have, unpaired when none match.

    The paired differences of every row and column get their intervals in one batch per size."""
    with_points = [row for row in data.rows if data.by_row[row]]
    pairs, unpaired = [], []
    for row in with_points:
        base = (
            baseline_row(row, with_points, definition.baseline) if row.mask != definition.baseline else None
        )
        if base is None:
            continue
        mine = {p.seed: _run_values(p, labels, definition.average) for p in data.by_row[row]}
        theirs = {p.seed: _run_values(p, labels, definition.average) for p in data.by_row[base]}
        matched = tuple(sorted(mine.keys() & theirs.keys()))
        (pairs if matched else unpaired).append((row, base, matched, mine, theirs))
    differences = [[mine[s][label] - theirs[s][label] for s in matched]
                   for _, _, matched, mine, theirs in pairs for label in labels]  # fmt: skip
    results = iter(
        zip(differences, intervals.seed_intervals(differences, definition.confidence), strict=True)
    )
    out = {}
    for row, base, matched, _, _ in pairs:
        cells = {}
        for label in labels:
            d, estimate = next(results)
            cells[label] = Comparison(estimate, probability_of_improvement_paired(d), True, len(matched),
                                      p_value=paired_p_value(d))  # fmt: skip
        out[row] = ComparisonRow(row, base, matched, cells)
    for row, base, _, mine, theirs in unpaired:
        cells = {}
        for label in labels:
            x, y = [v[label] for v in mine.values()], [v[label] for v in theirs.values()]
            comparison = intervals.compare_unpaired(x, y, definition.confidence)
            cells[label] = dataclasses.replace(comparison, p_value=welch_p_value(x, y))
        out[row] = ComparisonRow(row, base, (), cells)
    return with_holm([out[row] for row in with_points if row in out], labels)


def with_holm(rows: list[ComparisonRow], labels: Sequence[str]) -> list[ComparisonRow]:
    """Holm-adjusted p-values, one family per column: every row's comparison with the baseline there."""
    adjusted = {label: holm([r.cells[label].p_value for r in rows]) for label in labels}
    return [
        dataclasses.replace(
            r,
            cells={label: dataclasses.replace(r.cells[label], p_holm=adjusted[label][i]) for label in labels},
        )  # fmt: skip
        for i, r in enumerate(rows)
    ]


def family_sizes(rows: list[ComparisonRow], labels: Sequence[str]) -> dict[str, int]:
    """The number of tests in each column's family (comparisons with a p-value)."""
    return {label: sum(math.isfinite(r.cells[label].p_value) for r in rows) for label in labels}


def plotted_rows(setting_rows: list[TableRow], definition: Definition) -> tuple[list[RowKey], bool]:
    """The rows a setting's figures draw: all of them, or each mask's best row when there are too many."""
    rows = [r for r in setting_rows if r.seeds]
    if len(rows) <= definition.max_lines:
        return [r.row for r in rows], False
    score = definition.average or definition.columns[0].label
    best: dict[str, TableRow] = {}
    for r in rows:
        if r.row.mask not in best or r.cells[score].mean > best[r.row.mask].cells[score].mean:
            best[r.row.mask] = r
    return [r.row for r in rows if best[r.row.mask] is r], True


def aligned(series: Sequence[Series]) -> tuple[np.ndarray, np.ndarray]:
    """Seeds × steps at the steps every seed logged."""
    by_step = [dict(one) for one in series]
    steps = sorted(set.intersection(*(set(one) for one in by_step)))
    values = [[one[s] for s in steps] for one in by_step]
    return np.array(steps, dtype=int), np.array(values, dtype=float).reshape(len(series), len(steps))


def _average_series(series: dict[str, Series]) -> Series:
    steps = sorted(set.intersection(*({s for s, _ in c} for c in series.values())))
    by_label = [dict(c) for c in series.values()]
    return [(s, mean([c[s] for c in by_label])) for s in steps]


def curves(
    ledger: Ledger, data: Collected, definition: Definition, rows: list[TableRow]
) -> list[SettingCurves]:
    """Per setting: eval curves (a panel per column and the average) and training-dynamics panels, from one
    bulk read of the drawn runs' histories."""
    settings: dict[str, list[TableRow]] = defaultdict(list)
    for r in rows:
        settings[r.row.setting].append(r)
    chosen = {s: plotted_rows(rs, definition) for s, rs in settings.items()}
    drawn = [p for keys, _ in chosen.values() for key in keys for p in data.by_row[key]]
    metrics = {m for p in drawn for m in p.metrics.values()} | {panel.metric for panel in definition.dynamics}
    histories = ledger.metric_histories([p.run_id for p in drawn], sorted(metrics)) if drawn else {}
    pending: list[
        tuple[str, str, str, RowKey, np.ndarray, np.ndarray]
    ] = []  # setting, kind, panel, row, data
    for setting, (keys, _) in chosen.items():
        for key in keys:
            runs = [histories.get(p.run_id, {}) for p in data.by_row[key]]
            evals = [{label: run.get(metric, []) for label, metric in p.metrics.items()}
                     for p, run in zip(data.by_row[key], runs, strict=True)]  # fmt: skip
            for column in definition.columns:
                pending.append(
                    (setting, "eval", column.label, key, *aligned([e[column.label] for e in evals]))
                )
            if definition.average:
                pending.append(
                    (setting, "eval", definition.average, key, *aligned([_average_series(e) for e in evals]))
                )
            for panel in definition.dynamics:
                series = [run.get(panel.metric) for run in runs]
                if all(series):
                    pending.append((setting, "dynamics", panel.label, key, *aligned(series)))
    computed = intervals.bands([values for *_, values in pending], definition.confidence.for_bands)
    panels: dict[tuple[str, str], dict[str, list[Line]]] = defaultdict(lambda: defaultdict(list))
    for (setting, kind, label, key, steps, values), (centre, low, high) in zip(
        pending, computed, strict=True
    ):
        panels[setting, kind][label].append(Line(key, steps, centre, low, high, values.shape[0]))
    return [SettingCurves(setting, keys, by_best, dict(panels[setting, "eval"]), dict(panels[setting, "dynamics"]))
            for setting, (keys, by_best) in chosen.items() if keys]  # fmt: skip


def load_analysis(path: Path) -> dict:
    """A direction analysis written by `AnalysisResult.to_json` (pdmctl analyze)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"--analysis: cannot read {path} ({exc})") from exc
    if not isinstance(data, dict) or "comparisons" not in data:
        raise ReportError(f"--analysis: {path} is not a direction analysis (no 'comparisons')")
    from pdmctl.report.tables import _analysis_result

    try:  # every field the tables and figures read, before any work
        _analysis_result(data)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        why = " ".join(str(exc).split())[:200]
        raise ReportError(f"--analysis: {path} is not a whole direction analysis ({type(exc).__name__}: {why})") from None
    return data
