"""From the ledger to the report's data: which runs count, which row each belongs to, its value per column.

A run counts when MLflow says it FINISHED, it logged every column's metric, its values at the selected
evaluation are finite, and its last evaluation is as late as its row's latest. A run its declared collapse
rule stopped (pdmctl.budget.collapse) counts too, at its last evaluation, marked as stopped: leaving it out would
keep only the seeds that did not collapse. Every other run of the sweeps is listed with the reason it was
left out, and so is every seed a row lacks.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdmctl.budget.collapse import REASON_PREFIX
from pdmctl.ledger import FINISHED, KILLED, STATUS_METRICS, Ledger, RunRecord, flatten
from pdmctl.report.definition import Definition
from pdmctl.report.stats import Series, values_at

SETTING_FIELDS = ("model.name", "precision.name")
# shown in their own columns (δ, K); every other field that varies within a (setting, mask, δ, K) becomes
# a column too
_IGNORED = {"seed", "model.name", "precision.name", "mask.name", "delta", "delta_low", "k"}


@dataclass(frozen=True, order=True)
class RowKey:
    setting: str  # model · precision
    mask: str
    dims: tuple[tuple[str, str], ...] = ()  # (column label, value) for δ, K and other fields that vary

    def dim(self, label: str) -> str:
        return dict(self.dims).get(label, "")

    @property
    def label(self) -> str:
        return " ".join([self.mask, *(f"{k}={v}" for k, v in self.dims if v != "—")])


@dataclass(frozen=True)
class RunPoint:
    """A run that counts: its row, seed, value per column and evaluation curves."""

    run_id: str
    row: RowKey
    seed: int
    metrics: dict[str, str]  # column label -> the metric that filled it (eval/aime24 or eval/toy24, ...)
    values: dict[str, float]  # column label -> value at the selected evaluation(s)
    steps: tuple[int, ...]  # the evaluation steps those values were read at
    evaluations: dict[str, Series]  # column label -> the points read: the history, or only the final one
    stopped: str | None = None  # "stopped: collapse at step N" where its declared collapse rule ended it


@dataclass(frozen=True)
class Exclusion:
    """A run (or a seed without one) left out of the averages, and why."""

    row: RowKey | None
    seed: int | None
    run_id: str | None
    status: str
    reason: str


@dataclass(frozen=True)
class Collected:
    by_row: dict[RowKey, list[RunPoint]]  # every row (in `rows` order) -> its runs that count, by seed
    excluded: list[Exclusion]
    rows: list[RowKey]  # every row with a run in the ledger, in table order
    dims: tuple[str, ...]  # labels of the row dimensions that vary
    records: dict[str, RunRecord] = field(default_factory=dict)  # run id -> its ledger record (provenance)


def _row_fields(record: RunRecord, config: Mapping[str, Any]) -> dict[str, str]:
    fields = flatten(config)
    fields["sweep"] = record.sweep
    for name in [n for n, v in fields.items() if n.startswith("stop.") and v == "None"]:
        del fields[name]  # no rule: the same row as a run from before the field was there
    if config.get("mask", {}).get("method") == "grpo":  # the ratio clip ignores δ (its run key drops it too)
        fields["delta"] = fields["delta_low"] = "—"
    return fields


def _delta_label(fields: Mapping[str, str]) -> str:
    low = fields.get("delta_low", "None")
    if fields["delta"] == "—":
        return "—"
    return _number(fields["delta"]) + ("" if low in ("None", "—") else f"/{_number(low)}")


def _number(text: str) -> str:
    try:
        return f"{float(text):g}"
    except ValueError:
        return text


def _base(fields: Mapping[str, str]) -> tuple[str, ...]:
    return (*(fields.get(f, "") for f in SETTING_FIELDS), fields.get("mask.name", ""), _delta_label(fields),
            fields.get("k", ""))  # fmt: skip


def _extra_dims(all_fields: Sequence[Mapping[str, str]]) -> list[str]:
    """Fields that take more than one value among runs with the same setting, mask, δ and K: averaging
    over them would mix different experiments, so they split rows. A field that the ones already chosen
    determine adds nothing (the sweep name, when the sweeps differ in a config field, comes last)."""
    names = [*sorted({name for fields in all_fields for name in fields} - _IGNORED - {"sweep"}), "sweep"]
    keys = [_base(fields) for fields in all_fields]
    chosen: list[str] = []
    for name in names:
        groups: dict[tuple[str, ...], set[str]] = defaultdict(set)
        for key, fields in zip(keys, all_fields, strict=True):
            groups[key].add(fields.get(name, ""))
        if any(len(values) > 1 for values in groups.values()):
            chosen.append(name)
            keys = [(*key, fields.get(name, "")) for key, fields in zip(keys, all_fields, strict=True)]
    return chosen


def row_keys(records: Sequence[RunRecord]) -> tuple[dict[str, RowKey], dict[str, int], tuple[str, ...]]:
    """run id -> its row, run id -> its seed; the labels of the dimensions that vary (δ, K where they vary)."""
    fields, seeds = {}, {}
    for r in records:
        spec = r.spec
        if spec is not None:
            fields[r.run_id] = _row_fields(r, spec.config)
            seeds[r.run_id] = spec.seed
    extra = _extra_dims(list(fields.values()))
    deltas = {_delta_label(f) for f in fields.values()} - {"—"}
    ks = {f.get("k", "") for f in fields.values()}
    dims = (["δ"] if len(deltas) > 1 else []) + (["K"] if len(ks) > 1 else []) + extra
    keys = {}
    for run_id, f in fields.items():
        values = {"δ": _delta_label(f), "K": f.get("k", ""), **{name: f.get(name, "") for name in extra}}
        keys[run_id] = RowKey(
            setting=" · ".join(f.get(name, "?") for name in SETTING_FIELDS),
            mask=f.get("mask.name", "?"),
            dims=tuple((d, values[d]) for d in dims),
        )
    return keys, seeds, tuple(dims)


def _sort_key(row: RowKey, baseline: str) -> tuple:
    def natural(value: str) -> tuple:
        try:
            return (0, float(value.split("/")[0]), value)
        except ValueError:
            return (1, 0.0, value)

    return (row.setting, row.mask != baseline, row.mask, *(natural(v) for _, v in row.dims))


def column_metrics(history: Mapping[str, Series], definition: Definition) -> tuple[dict[str, str], list[str]]:
    """Each column's metric (the first of its metrics the run logged); the columns it lacks."""
    metrics, missing = {}, []
    for column in definition.columns:
        metric = next((m for m in column.metrics if history.get(m)), None)
        if metric is None:
            missing.append(f"{column.label} ({' or '.join(column.metrics)})")
        else:
            metrics[column.label] = metric
    return metrics, missing


def collect(ledger: Ledger, sweeps: Sequence[str], definition: Definition) -> Collected:
    records = [r for sweep in sweeps for r in ledger.runs(sweep)]
    keys, seeds, dims = row_keys(records)
    excluded = [Exclusion(None, None, r.run_id, r.status, "its run spec is unreadable")
                for r in records if r.run_id not in keys]  # fmt: skip
    finished = [r for r in records if r.run_id in keys and (r.status == FINISHED or stopped_by_rule(r))]
    for r in records:
        if r.run_id in keys and r.status != FINISHED and not stopped_by_rule(r):
            where = f" (last logged step {r.step})" if r.step is not None else " (nothing logged)"
            excluded.append(
                Exclusion(keys[r.run_id], seeds[r.run_id], r.run_id, r.status, f"not finished{where}")
            )
    histories = _evaluations(ledger, finished, definition)
    candidates: list[RunPoint] = []
    for r in finished:
        history = histories.get(r.run_id, {})
        metrics, missing = column_metrics(history, definition)
        row, seed = keys[r.run_id], seeds[r.run_id]
        if missing:
            excluded.append(Exclusion(row, seed, r.run_id, r.status, f"no {', '.join(missing)} logged"))
            continue
        series = {label: history[metric] for label, metric in metrics.items()}
        values, steps = values_at(series, definition.at)
        bad = [label for label, v in values.items() if not math.isfinite(v)]
        if not steps:
            excluded.append(Exclusion(row, seed, r.run_id, r.status, "its columns share no evaluation step"))
        elif bad:
            excluded.append(Exclusion(row, seed, r.run_id, r.status,
                                      f"{', '.join(bad)} not finite at step {', '.join(map(str, steps))}"))  # fmt: skip
        else:
            candidates.append(RunPoint(r.run_id, row, seed, metrics, values, tuple(steps), series,
                                       stopped_mark(r) if stopped_by_rule(r) else None))  # fmt: skip
    points = _drop_partial(candidates, excluded)
    points = _drop_duplicates(points, excluded)
    rows = sorted(
        {keys[r.run_id] for r in records if r.run_id in keys}, key=lambda k: _sort_key(k, definition.baseline)
    )
    excluded += _missing_seeds(keys, seeds)
    by_row: dict[RowKey, list[RunPoint]] = {row: [] for row in rows}
    for p in sorted(points, key=lambda p: p.seed):
        by_row[p.row].append(p)
    return Collected(by_row, excluded, rows, dims, {r.run_id: r for r in records})


def stopped_by_rule(record: RunRecord) -> bool:
    """Whether the run's declared collapse rule ended it (its job's reason, pdmctl.job)."""
    return record.status == KILLED and (record.reason or "").startswith(REASON_PREFIX)


def stopped_mark(record: RunRecord) -> str:
    """`stopped: collapse at step N`, the step from the job's reason (else the last one logged)."""
    found = re.search(r"at step (\d+)", record.reason or "")
    return f"stopped: collapse at step {found.group(1) if found else record.step}"


def _evaluations(
    ledger: Ledger, finished: Sequence[RunRecord], definition: Definition
) -> dict[str, dict[str, Series]]:
    """run id -> metric -> the points the table needs. The final evaluation of the metrics `status` shows
    is already in each record (MLflow's latest value), so the default report reads no history for its
    table; `best` and `last-N` (and other metrics) read the histories in bulk."""
    if definition.at.kind == "final" and set(definition.eval_metrics) <= set(STATUS_METRICS):
        return {r.run_id: {k: [point] for k, point in r.latest.items()} for r in finished}
    return ledger.metric_histories([r.run_id for r in finished], definition.eval_metrics)


def _drop_partial(points: list[RunPoint], excluded: list[Exclusion]) -> list[RunPoint]:
    """A finished run whose last evaluation comes before its row's latest stopped early (or was cut short)."""
    last: dict[RowKey, int] = defaultdict(int)
    for p in points:
        if p.stopped is None:
            last[p.row] = max(last[p.row], _last_step(p))
    kept = []
    for p in points:
        if p.stopped is None and _last_step(p) < last[p.row]:
            excluded.append(Exclusion(p.row, p.seed, p.run_id, FINISHED,
                                      f"partial: last evaluation at step {_last_step(p)}, its row's at {last[p.row]}"))  # fmt: skip
        else:
            kept.append(p)
    return kept


def _last_step(point: RunPoint) -> int:
    return max(max(s for s, _ in series) for series in point.evaluations.values())


def _drop_duplicates(points: list[RunPoint], excluded: list[Exclusion]) -> list[RunPoint]:
    """Two runs of one row with one seed (the same config in two sweeps): the first counts, the other is listed."""
    seen: set[tuple[RowKey, int]] = set()
    kept = []
    for p in points:
        if (p.row, p.seed) in seen:
            excluded.append(
                Exclusion(p.row, p.seed, p.run_id, FINISHED, "duplicate of another run with this seed")
            )
        else:
            seen.add((p.row, p.seed))
            kept.append(p)
    return kept


def _missing_seeds(keys: Mapping[str, RowKey], seeds: Mapping[str, int]) -> list[Exclusion]:
    """Seeds that other rows of the report have and a row lacks altogether (never registered)."""
    seeds_of: dict[RowKey, set[int]] = defaultdict(set)
    for run_id, row in keys.items():
        seeds_of[row].add(seeds[run_id])
    every = set().union(*seeds_of.values()) if seeds_of else set()
    return [Exclusion(row, seed, None, "MISSING", "no run in the ledger")
            for row, row_seeds in seeds_of.items() for seed in sorted(every - row_seeds)]  # fmt: skip
