"""`pdmctl report --json`: the tables the report prints, as one JSON document (docs/JSON.md).

The numbers are the tables' own, unrounded to six decimals: avg@16 in percent (`_pct`), differences in
percentage points (`_pp`); null where a table says n/a (fewer than two seeds, no test). The rendered report is
written as without --json; the document names where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdmctl.report.collect import RowKey
from pdmctl.report.intervals import comparison_interval, short_name
from pdmctl.report.model import Report
from pdmctl.report.stats import Estimate
from pdmctl.shell import number


def _row(row: RowKey) -> dict[str, Any]:
    return {"setting": row.setting, "mask": row.mask, "label": row.label, "dims": dict(row.dims)}


def _pct(value: float | None) -> float | None:
    return number(None if value is None else 100 * value)


def _estimate(e: Estimate, unit: str) -> dict[str, Any]:
    iv = e.interval if e.n else None
    return {f"mean_{unit}": _pct(e.mean) if e.n else None, f"low_{unit}": _pct(iv.low) if iv else None,
            f"high_{unit}": _pct(iv.high) if iv else None, "n": e.n}  # fmt: skip


def report_document(report: Report, out_dir: Path, written: list[Path]) -> dict[str, Any]:
    """The results table, the comparisons with the baseline (with the power table's columns), the runs left
    out and the cost table, with the files written."""
    from pdmctl.ledger import _redact
    from pdmctl.report.build import pooling_notes
    from pdmctl.report.tables import cost_table

    d = report.definition
    columns = [{"label": label, "name": report.name(label)} for label in report.labels]
    results = [{**_row(r.row), "seeds": list(r.seeds), "stopped": list(r.stopped),
                "values": {label: {**_estimate(r.cells[label], "pct"), "two_level": bool(r.two_level.get(label))}
                           for label in report.labels}}
               for r in report.rows]  # fmt: skip
    comparisons = []
    for comp in report.comparisons:
        values = {}
        for label in report.labels:
            c = comp.cells[label]
            estimate = _estimate(c.difference, "pp")
            values[label] = {
                "difference_pp": estimate["mean_pp"], "low_pp": estimate["low_pp"], "high_pp": estimate["high_pp"],
                "n": c.difference.n, "n_baseline": c.n_baseline,
                "probability_of_improvement": number(c.probability_of_improvement), "p": number(c.p_value),
                "p_holm": number(c.p_holm), "seeds_needed": c.seeds_needed, "resolvable_pp": _pct(c.resolvable),
            }  # fmt: skip
        comparisons.append({**_row(comp.row), "baseline": _row(comp.baseline), "paired": bool(comp.seeds),
                            "seeds": list(comp.seeds), "interval": comparison_interval(comp, d.confidence),
                            "values": values})  # fmt: skip
    excluded = [{**(_row(e.row) if e.row else {"setting": None, "mask": None, "label": None, "dims": {}}),
                 "seed": e.seed, "status": e.status.lower(), "reason": e.reason, "run_id": e.run_id}
                for e in report.excluded]  # fmt: skip
    cost = None
    if any(not isinstance(c, str) for c in report.cost):
        table = cost_table(report)
        cost = {"columns": list(table.headers), "rows": [list(r) for r in table.rows], "note": table.note}
    return {
        "command": "report", "sweeps": list(report.sweeps), "tracking_uri": _redact(report.tracking_uri),
        "definition": {"name": d.name, "at": str(d.at), "baseline": d.baseline, "interval": short_name(d.confidence),
                       "level": d.confidence.level, "average": d.average},
        "columns": columns, "baseline_present": report.baseline_present, "results": results,
        "comparisons": comparisons, "excluded": excluded, "cost": cost, "notes": pooling_notes(report),
        "out": str(out_dir), "written": [str(p) for p in written],
    }  # fmt: skip
