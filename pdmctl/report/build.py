"""The report as data: tables of estimates, comparisons with the baseline, curves with seed bands.

`build_report` reads the ledger (a few bulk statements) and returns a `Report`; `pdmctl.report.write`
turns it into files. Nothing here draws or formats.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdmctl.budget.collapse import collapse_rule
from pdmctl.ledger import Ledger, RunRecord, load_per_problem, load_samples
from pdmctl.provenance import PACKAGES, POOLING_FIELDS
from pdmctl.report import intervals, passk, power, resample, sequential
from pdmctl.report.collect import Collected, RowKey, RunPoint, collect
from pdmctl.report.definition import Definition, ReportError
from pdmctl.report.model import (  # the report's types, defined there and used here
    ComparisonRow,
    Line,
    PassKRow,
    ProvenanceRow,
    Report,
    SettingCurves,
    TableRow,
)
from pdmctl.report.stats import (
    Comparison,
    Estimate,
    Interval,
    Series,
    holm,
    mean,
    paired_p_value,
    pct,
    probability_of_improvement_paired,
    welch_p_value,
)


def build_report(ledger: Ledger, sweeps: Sequence[str], definition: Definition, *, two_level: bool = False,
                 analysis: Path | None = None) -> Report:  # fmt: skip
    direction = load_analysis(analysis) if analysis else None  # a wrong path fails before any work
    queries_before = getattr(ledger, "queries", 0)
    data = collect(ledger, sweeps, definition)
    check_one_data(data)
    labels = tuple(c.label for c in definition.columns) + (
        (definition.average,) if definition.average else ()
    )
    rows = table_rows(data, definition, labels)
    if two_level:
        rows = [with_two_level(row, data.by_row[row.row], ledger.uri, definition) for row in rows]
    rows, clipped_rows = clip_rows(rows)
    compared, staged = sequential.apply(comparisons(data, definition, labels), data, definition, labels)
    compared, clipped_differences = clip_comparisons(compared, rows)
    passes, clipped_passes = clip_pass_k(pass_k_rows(data, definition, labels, ledger))
    drawn, constant = informative(curves(ledger, data, definition, rows))
    return Report(
        sweeps=tuple(sweeps),
        tracking_uri=ledger.uri,
        definition=definition,
        dims=data.dims,
        labels=labels,
        rows=rows,
        comparisons=compared,
        excluded=data.excluded,
        curves=drawn,
        two_level=two_level,
        baseline_present=any(r.mask == definition.baseline for r in data.rows),
        analysis=direction,
        queries=getattr(ledger, "queries", 0) - queries_before,
        provenance=provenance_rows(data),
        pass_k=passes,
        names=held_out_names(data, definition),
        clipped=clipped_rows + clipped_differences + clipped_passes,
        constant_panels=constant,
        sequential=staged,
        collapse_rules=declared_rules(data),
    )


def declared_rules(data: Collected) -> tuple[str, ...]:
    """The collapse rules the report's runs declared (pdmctl.budget.collapse), each described once."""
    rules = {collapse_rule(r.spec.config) for r in data.records.values() if r.spec is not None}
    return tuple(sorted(rule.describe() for rule in rules if rule is not None))


# ---------------------------------------------------------------------------
# What the page calls each column; intervals kept inside the range of their quantity
# ---------------------------------------------------------------------------


def held_out_names(data: Collected, definition: Definition) -> dict[str, str]:
    """Column label -> the held-out set(s) its counted runs logged, by the metric's name without `eval/`:
    a column filled from `eval/toy24` is shown as toy24, not under the label meant for AIME24."""
    out = {}
    for column in definition.columns:
        sets = sorted({p.metrics[column.label].removeprefix("eval/") for points in data.by_row.values()
                       for p in points if column.label in p.metrics})  # fmt: skip
        if sets and [s.lower() for s in sets] != [column.label.lower()]:
            out[column.label] = " / ".join(sets)
    return out


UNIT = (0.0, 1.0)  # avg@16, pass@k, maj@k: fractions
DIFFERENCE = (-1.0, 1.0)  # a difference of two fractions


def _clip(estimate: Estimate, bounds: tuple[float, float]) -> tuple[Estimate, bool]:
    iv = estimate.interval
    if iv is None or (iv.low >= bounds[0] and iv.high <= bounds[1]):
        return estimate, False
    return Estimate(estimate.mean, estimate.n, Interval(max(iv.low, bounds[0]), min(iv.high, bounds[1]))), True


def _in_unit(values: Sequence[float]) -> bool:
    return bool(values) and all(UNIT[0] <= v <= UNIT[1] for v in values)


def clip_rows(rows: list[TableRow]) -> tuple[list[TableRow], int]:
    """Each interval of a column whose every seed lies in [0, 1] (a fraction: avg@16) clipped to [0, 1]: a
    t interval over a few seeds near 100% reaches past it. Returns the rows and how many were clipped."""
    out, count = [], 0
    for r in rows:
        cells = dict(r.cells)
        for label, e in r.cells.items():
            if _in_unit(r.per_seed.get(label, ())):
                cells[label], clipped = _clip(e, UNIT)
                count += clipped
        out.append(dataclasses.replace(r, cells=cells))
    return out, count


def clip_comparisons(rows: list[ComparisonRow], table: list[TableRow]) -> tuple[list[ComparisonRow], int]:
    """A difference of two fractions lies in [-1, 1]: its interval clipped there."""
    values = {r.row: r.per_seed for r in table}
    out, count = [], 0
    for comp in rows:
        cells = dict(comp.cells)
        for label, c in comp.cells.items():
            if all(_in_unit(values.get(key, {}).get(label, ())) for key in (comp.row, comp.baseline)):
                difference, clipped = _clip(c.difference, DIFFERENCE)
                cells[label] = dataclasses.replace(c, difference=difference)
                count += clipped
        out.append(dataclasses.replace(comp, cells=cells))
    return out, count


def clip_pass_k(rows: list[PassKRow]) -> tuple[list[PassKRow], int]:
    """pass@k and maj@k are fractions: their intervals clipped to [0, 1]."""
    out, count = [], 0
    for r in rows:
        cells = {}
        for key, e in r.cells.items():
            cells[key], clipped = _clip(e, UNIT)
            count += clipped
        out.append(dataclasses.replace(r, cells=cells))
    return out, count


FLAT = 0.01  # a panel whose every line and band stays within 1% of one value is drawn as a sentence


def informative(drawn: list[SettingCurves]) -> tuple[list[SettingCurves], dict[str, float]]:
    """The curves without the training-dynamics and mismatch panels whose every line and band stays within
    1% of one value at every step (the testbed's response length, fixed by its task): such a panel says
    nothing a sentence does not. Returns the curves and each panel left out with its mean value."""
    constant: dict[str, float] = {}

    def keep(panels: dict[str, list[Line]]) -> dict[str, list[Line]]:
        kept = {}
        for label, lines in panels.items():
            values = np.concatenate([a for ln in lines for a in (ln.centre, ln.low, ln.high)]) if lines else np.array([])
            values = values[np.isfinite(values)]
            if values.size and np.ptp(values) <= FLAT * np.abs(values).max():
                constant[label] = float(np.mean(np.concatenate([ln.centre for ln in lines])))
            else:
                kept[label] = lines
        return kept

    out = [dataclasses.replace(c, dynamics_panels=keep(c.dynamics_panels), mismatch_panels=keep(c.mismatch_panels))
           for c in drawn]  # fmt: skip
    return out, constant


# ---------------------------------------------------------------------------
# Provenance (pdmctl.provenance; recorded by each attempt of a job)
# ---------------------------------------------------------------------------

# what a panel's quantity can be: accuracies in [0, 1]; the mismatch panel's gaps, fractions and counts, and
# the training dynamics' lengths, KLs and fractions >= 0 (a panel whose values go below 0 is left as it is)
BAND_RANGE = {"eval": (0.0, 1.0), "mismatch": (0.0, math.inf), "dynamics": (0.0, math.inf)}


def _within_range(kind: str, values: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A t band drawn inside the range its quantity can take (two seeds' band of a fraction reached below 0):
    clipped when every value of the line is in the panel's range (a definition's own metric may not be)."""
    bounds = BAND_RANGE.get(kind)
    finite = values[np.isfinite(values)]
    if bounds is None or not finite.size or finite.min() < bounds[0] or finite.max() > bounds[1]:
        return low, high
    return np.clip(low, *bounds), np.clip(high, *bounds)


NOT_RECORDED = "not recorded"
PROVENANCE_FIELDS = ("commit", "dirty", *(f"version.{p}" for p in PACKAGES), "data", "eval_sampling")


def _attempts(record: RunRecord) -> list[dict]:
    return record.attempts or ([{"attempt": record.attempt, "job_id": record.job_id}] if record.job_id else [])


def provenance_rows(data: Collected) -> list[ProvenanceRow]:
    out = []
    for row in data.rows:
        records = [data.records[p.run_id] for p in data.by_row[row] if p.run_id in data.records]
        if not records:
            continue
        values = {f: tuple(sorted({r.provenance.get(f, NOT_RECORDED) for r in records})) for f in PROVENANCE_FIELDS}
        attempts = [a for r in records for a in _attempts(r)]
        # a run resumed under other code: its attempts' commits differ, though its latest tags are one
        commits = set(values["commit"]) | {a["commit"] for a in attempts if a.get("commit")}
        mixed = [f for f in POOLING_FIELDS if f in values and len(values[f]) > 1]
        if len(commits) > 1 and "commit" not in mixed:
            mixed.insert(0, "commit")
            values["commit"] = tuple(sorted(commits))
        out.append(ProvenanceRow(row, values, len(records), len(attempts),
                                 tuple(str(a["job_id"]) for a in attempts if a.get("job_id")), tuple(mixed)))  # fmt: skip
    return out


def check_one_data(data: Collected) -> None:
    """Refuse (ReportError, one line) a report whose compared runs were trained on different data: within a
    setting, runs whose configs pin different data manifests (`backend.data_manifest`, pinned at submit),
    or within a row, runs whose jobs recorded different data (provenance `data`)."""
    pinned: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row, points in data.by_row.items():
        recorded: dict[str, int] = defaultdict(int)
        for p in points:
            record = data.records.get(p.run_id)
            spec = record.spec if record is not None else None
            digest = ((spec.config.get("backend") or {}).get("data_manifest") if spec is not None else None)
            if digest:
                pinned[row.setting][str(digest)] += 1
            value = record.provenance.get("data") if record is not None else None
            if value and value != NOT_RECORDED:
                recorded[value] += 1
        if len(recorded) > 1:
            raise ReportError(f"row {row.setting} {row.label} pools runs trained on different data "
                              f"({_digests(recorded)}, as their jobs recorded it): report each data set's sweep "
                              "on its own")  # fmt: skip
    for setting, digests in pinned.items():
        if len(digests) > 1:
            raise ReportError(f"setting {setting}: its runs were trained on different data ({_digests(digests)}, "
                              "backend.data_manifest): report each data set's runs on their own")  # fmt: skip


def _digests(counts: dict[str, int]) -> str:
    return ", ".join(f"{value[:16]} in {n} run(s)" for value, n in sorted(counts.items()))


def pooling_notes(report: Report) -> list[str]:
    """One line per row that pools runs of different commits, versions or data."""
    lines = []
    for p in report.provenance:
        if p.mixed:
            parts = [f"{len(p.values[f])} {f.removeprefix('version.')} values ({', '.join(v[:12] for v in p.values[f])})"
                     for f in p.mixed]  # fmt: skip
            lines.append(f"row {p.row.setting} {p.row.label} pools runs of {'; '.join(parts)}")
    return lines


# ---------------------------------------------------------------------------
# pass@k and maj@k from per-sample correctness
# ---------------------------------------------------------------------------


def _run_pass_k(point: RunPoint, definition: Definition, uri: str, location: str | None
                ) -> tuple[int, dict[str, tuple]] | None:  # fmt: skip
    """(n, column label -> (pass@k, maj@k) arrays over passk.ks_for(n)) for one run, or None where it has
    no per-sample record at every evaluation the table reads (or the numbers of samples differ)."""
    loaded = {}
    for column in definition.columns:
        dataset = point.metrics[column.label].removeprefix("eval/")
        for step in point.steps:
            found = load_samples(uri, point.run_id, dataset, step, location)
            if found is None:
                return None
            loaded[column.label, step] = (np.asarray(found[0]), np.asarray(found[1]))
    sizes = {c.shape[1] for c, _ in loaded.values() if c.ndim == 2}
    if len(sizes) != 1 or any(c.ndim != 2 or c.shape != a.shape for c, a in loaded.values()):
        return None
    n = sizes.pop()
    ks = passk.ks_for(n)
    per_label = {}
    try:
        for column in definition.columns:
            per_step = [passk.scores(*loaded[column.label, step], ks) for step in point.steps]
            per_label[column.label] = tuple(np.mean([s[i] for s in per_step], axis=0) for i in (0, 1))
    except ValueError:  # answers that contradict their grades (passk._groups): not usable, left out
        return None
    return n, per_label


def pass_k_rows(data: Collected, definition: Definition, labels: Sequence[str], ledger: Ledger) -> list[PassKRow]:
    rows: list[tuple[RowKey, tuple[int, ...], int, dict[str, list[tuple]]]] = []
    counted = [p.run_id for points in data.by_row.values() for p in points]
    locations = ledger.artifact_locations(counted) if counted else {}
    for row in data.rows:
        points = data.by_row[row]
        if not points:
            continue
        runs = []
        for p in points:
            found = _run_pass_k(p, definition, ledger.uri, locations.get(p.run_id))
            if found is None:
                break
            runs.append(found)
        if len(runs) != len(points) or len({n for n, _ in runs}) != 1:
            continue
        per_label = {label: [r[1][label] for r in runs] for label in (c.label for c in definition.columns)}
        if definition.average:
            per_label[definition.average] = [tuple(np.mean([r[1][c.label][i] for c in definition.columns], axis=0)
                                                   for i in (0, 1)) for r in runs]  # fmt: skip
        rows.append((row, tuple(p.seed for p in points), runs[0][0], per_label))
    samples, keys = [], []
    for row, _, n, per_label in rows:
        for label in (lbl for lbl in labels if lbl in per_label):
            for m, kind in enumerate(("pass", "maj")):
                for j, k in enumerate(passk.ks_for(n)):
                    samples.append([float(run[m][j]) for run in per_label[label]])
                    keys.append((row, label, kind, k))
    estimates = dict(zip(keys, intervals.seed_intervals(samples, definition.confidence), strict=True))
    return [PassKRow(row, seeds, n, tuple(passk.ks_for(n)),
                     {(label, kind, k): e for (r, label, kind, k), e in estimates.items() if r == row})
            for row, seeds, n, _ in rows]  # fmt: skip


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
                     per_seed={label: tuple(next(per_seed)) for label in labels},
                     stopped=tuple(f"seed {p.seed} {p.stopped} (avg@16 {pct(_run_mean(p, labels))}%)"
                                   for p in data.by_row[row] if p.stopped))
            for row in data.rows]  # fmt: skip


def _run_mean(point: RunPoint, labels: Sequence[str]) -> float:
    """The mean of a run's values over the columns (for a run its rule stopped: at its last evaluation)."""
    return mean([point.values[label] for label in labels if label in point.values])


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
            cells[label] = with_power(Comparison(estimate, probability_of_improvement_paired(d), True, len(matched),
                                                 p_value=paired_p_value(d)), d)  # fmt: skip
        out[row] = ComparisonRow(row, base, matched, cells)
    for row, base, _, mine, theirs in unpaired:
        cells = {}
        for label in labels:
            x, y = [v[label] for v in mine.values()], [v[label] for v in theirs.values()]
            comparison = intervals.compare_unpaired(x, y, definition.confidence)
            cells[label] = with_power(dataclasses.replace(comparison, p_value=welch_p_value(x, y)), x, y)
        out[row] = ComparisonRow(row, base, (), cells)
    return with_holm([out[row] for row in with_points if row in out], labels)


def with_power(comparison: Comparison, x: Sequence[float], y: Sequence[float] | None = None) -> Comparison:
    """The comparison with the seeds its difference needs (80% power at 5%, `power`) given the seeds'
    observed spread, and the smallest difference the present seeds resolve. `x`: the per-seed differences
    (paired), or the mask's values against the baseline's `y` (unpaired: the pooled spread, seeds per mask)."""
    a = np.asarray(x, dtype=float)
    if y is None:
        if a.size < 2:
            return comparison
        spread, resolvable = float(a.std(ddof=1)), _resolvable(a.size, None)
    else:
        b = np.asarray(y, dtype=float)
        if a.size < 2 or b.size < 2:
            return comparison
        pooled = ((a.size - 1) * a.var(ddof=1) + (b.size - 1) * b.var(ddof=1)) / (a.size + b.size - 2)
        spread, resolvable = math.sqrt(pooled), _resolvable(a.size, b.size)
    if np.ptp(a) == 0 and (y is None or np.ptp(b) == 0):  # every seed the same (a collapsed run scores 0 on
        return dataclasses.replace(comparison, spread=0.0)  # each): no t-test, no power (std is ~1e-17 there)
    difference = comparison.difference.mean
    effect = abs(difference) / spread
    return dataclasses.replace(comparison, spread=spread, resolvable=resolvable * spread,
                               seeds_needed=power.seeds_needed(effect, paired=y is None))  # fmt: skip


@functools.lru_cache(maxsize=256)
def _resolvable(n_x: int, n_y: int | None) -> float:
    return power.resolvable(n_x, n_y)


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
    # a run its collapse rule stopped counts in the table at its last evaluation; the curves draw the runs that
    # trained to their end (a band over steps where some seeds are missing would mix two populations)
    trained = {key: [p for p in data.by_row[key] if p.stopped is None] for key in data.by_row}
    chosen = {s: ([k for k in keys if trained[k]], by_best) for s, (keys, by_best) in chosen.items()}
    drawn = [p for keys, _ in chosen.values() for key in keys for p in trained[key]]
    metrics = {m for p in drawn for m in p.metrics.values()} | {panel.metric for panel in definition.dynamics}
    mismatch = definition.mismatch if "mismatch" in definition.panels else ()
    metrics |= {m for panel in mismatch for m in panel.metrics}
    drawn_metrics: dict[tuple[str, str], set[str]] = defaultdict(set)  # (setting, panel) -> metrics drawn
    histories = ledger.metric_histories([p.run_id for p in drawn], sorted(metrics)) if drawn else {}
    pending: list[
        tuple[str, str, str, RowKey, np.ndarray, np.ndarray]
    ] = []  # setting, kind, panel, row, data
    for setting, (keys, _) in chosen.items():
        for key in keys:
            runs = [histories.get(p.run_id, {}) for p in trained[key]]
            evals = [{label: run.get(metric, []) for label, metric in p.metrics.items()}
                     for p, run in zip(trained[key], runs, strict=True)]  # fmt: skip
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
            for panel in mismatch:  # each run's first metric of the panel's that it logged
                names = [next((m for m in panel.metrics if run.get(m)), None) for run in runs]
                if all(names):
                    drawn_metrics[setting, panel.label].update(names)
                    pending.append((setting, "mismatch", panel.label, key,
                                    *aligned([run[m] for run, m in zip(runs, names, strict=True)])))  # fmt: skip
    computed = intervals.bands([values for *_, values in pending], definition.confidence.for_bands)
    panels: dict[tuple[str, str], dict[str, list[Line]]] = defaultdict(lambda: defaultdict(list))
    for (setting, kind, label, key, steps, values), (centre, low, high) in zip(
        pending, computed, strict=True
    ):
        low, high = _within_range(kind, values, low, high)
        panels[setting, kind][label].append(Line(key, steps, centre, low, high, values.shape[0]))
    return [SettingCurves(setting, keys, by_best, dict(panels[setting, "eval"]), dict(panels[setting, "dynamics"]),
                          dict(panels[setting, "mismatch"]),
                          {label: tuple(sorted(drawn_metrics[setting, label])) for label in panels[setting, "mismatch"]})
            for setting, (keys, by_best) in chosen.items() if keys]  # fmt: skip


def load_analysis(path: Path) -> dict:
    """A direction analysis written by `AnalysisResult.to_json` (pdmctl analyze)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"--analysis: cannot read {path} ({exc})") from exc
    if not isinstance(data, dict) or "comparisons" not in data:
        raise ReportError(f"--analysis: {path} is not a direction analysis (no 'comparisons')")
    from pdmctl.analysis.results import AnalysisResult

    try:  # every field the tables and figures read, before any work
        AnalysisResult.from_dict(data)
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        why = " ".join(str(exc).split())[:200]
        raise ReportError(f"--analysis: {path} is not a whole direction analysis ({type(exc).__name__}: {why})") from None
    return data
