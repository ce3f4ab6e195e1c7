"""Synthetic sweeps in a real SQLite MLflow store, for the report's tests and its benchmark.

Runs are registered by the ledger itself (`SqlLedger.register`, specs from `grid.expand`); their
metric points are written in bulk into MLflow's own `metrics` and `latest_metrics` tables the way
MLflow stores them (a NaN is value 0 with is_nan set), then the runs get their final status.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdmctl import grid
from pdmctl.ledger import FINISHED, SqlLedger
from pdmctl.spec import RunSpec

Point = tuple[str, str, int, float]  # run id, metric, step, value


@dataclass(frozen=True)
class SyntheticSweep:
    ledger: SqlLedger
    specs: dict[str, RunSpec]  # run id -> spec

    def run_id(self, mask: str, seed: int, **fields: object) -> str:
        """The run of `mask` with `seed` (and config fields such as delta=0.1, k=20)."""
        found = [rid for rid, s in self.specs.items()
                 if s.config["mask"]["name"] == mask and s.seed == seed
                 and all(s.config.get(k) == v for k, v in fields.items())]  # fmt: skip
        assert len(found) == 1, (mask, seed, fields, found)
        return found[0]


def make_sweep(uri: str, sweep: str, overrides: Sequence[str]) -> SyntheticSweep:
    specs = grid.expand(list(overrides), sweep=sweep)
    ledger = SqlLedger(uri)
    ids = ledger.register(specs, {s.key: f"/nonexistent/{s.key}" for s in specs})
    return SyntheticSweep(ledger, {ids[s.key]: s for s in specs})


def write_points(ledger: SqlLedger, points: Iterable[Point], chunk: int = 50_000) -> int:
    """Insert metric points (and each series' latest point) in bulk; returns how many."""
    now = int(time.time() * 1000)
    latest: dict[tuple[str, str], tuple[int, float]] = {}
    rows, n = [], 0
    metrics = ledger.t["metrics"]
    with ledger.engine.begin() as conn:
        for run_id, key, step, value in points:
            nan = math.isnan(value)
            rows.append({"key": key, "value": 0.0 if nan else value, "timestamp": now, "run_uuid": run_id,
                         "step": step, "is_nan": nan})  # fmt: skip
            if step >= latest.get((run_id, key), (-1, 0.0))[0]:
                latest[(run_id, key)] = (step, value)
            if len(rows) >= chunk:
                conn.execute(metrics.insert(), rows)
                n += len(rows)
                rows = []
        if rows:
            conn.execute(metrics.insert(), rows)
            n += len(rows)
        conn.execute(ledger.t["latest_metrics"].insert(), [
            {"key": key, "value": 0.0 if math.isnan(v) else v, "timestamp": now, "step": step,
             "is_nan": math.isnan(v), "run_uuid": run_id}
            for (run_id, key), (step, v) in latest.items()
        ])  # fmt: skip
    return n


def finish(ledger: SqlLedger, run_ids: Sequence[str], status: str = FINISHED, reason: str | None = None) -> None:
    ledger.set_status(list(run_ids), status, reason)


def test_synthetic_points_read_back_through_the_ledger(tmp_path: Path) -> None:
    sweep = make_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "synthetic", ["mask=pdm_agg", "seed=0,1"])
    first, second = sweep.specs
    write_points(sweep.ledger, [(first, "eval/toy24", 0, 0.25), (first, "eval/toy24", 2, 0.5),
                                (second, "eval/toy24", 0, 0.125)])  # fmt: skip
    finish(sweep.ledger, [first, second])
    histories = sweep.ledger.metric_histories([first, second], ["eval/toy24"])
    assert histories[first]["eval/toy24"] == [(0, 0.25), (2, 0.5)]
    assert histories[second]["eval/toy24"] == [(0, 0.125)]
    records = {r.run_id: r for r in sweep.ledger.runs("synthetic")}
    assert {r.status for r in records.values()} == {FINISHED}
    assert records[first].latest["eval/toy24"] == (2, 0.5)
