"""The SQL ledger against MLflow's own API on the embedded store: what writing rows into MLflow's tables
saves (pdmctl.ledger.sql's docstring quotes it).

N runs (a grid of masks, δ, K and seeds) are registered into a fresh SQLite store twice: by `SqlLedger`
(a few INSERTs into MLflow's tables) and by `ClientLedger` through MLflow's batch API (`create_run`,
`log_batch` of tags and params, `log_text` of spec.json, `update_run`: what MLflow offers, one run at a time).
`ClientLedger` runs 16 calls at once against a server; against the SQLite store MLflow's client shares
one connection pool (5 + 10 connections, 30 s to get one), which 16 threads exhausted on a loaded 2-core
machine (`QueuePool limit of size 5 overflow 10 reached`), so here it makes one call at a time. Each run
then gets two evaluations, and the sweep is read back as `pdmctl status` reads it: by the SQL ledger (three
SELECTs), and through MLflow's API (`search_runs`, which returns each metric's latest value but not its
step, so `ClientLedger` asks `get_metric_history` for every run and metric). It prints the seconds of each
and the number of statements or calls.

    python bench/ledger.py [--runs 512] [--dir /tmp/pdmctl-bench-ledger]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GRID = ["mask=pdm_agg,pdm_uni,dppo_topk_kl,dppo_topk_tv", "delta=0.05,0.1,0.15,0.2", "k=10,20,50,100",
        "seed=0,1,2,3,4,5,6,7", "backend=synthetic", "model=synthetic"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=512)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pdmctl-bench-ledger"))
    args = parser.parse_args()

    from mlflow.entities import Metric

    from pdmctl import grid
    from pdmctl.ledger import ClientLedger, SqlLedger, client, close_stores

    pool = client.ThreadPoolExecutor
    client.ThreadPoolExecutor = lambda _workers: pool(1)  # one call at a time on SQLite (the docstring)

    specs = grid.expand(GRID, sweep="bench")[: args.runs]
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"{len(specs)} runs, each registered and read back as `pdmctl status` reads it")
    for kind in ("sql", "client"):
        where = args.dir / kind
        where.mkdir(parents=True)
        uri = f"sqlite:///{where / 'mlflow.db'}"
        SqlLedger(uri)  # the schema, untimed
        ledger = SqlLedger(uri) if kind == "sql" else ClientLedger(uri)
        began = time.perf_counter()
        ids = ledger.register(specs, {s.key: str(where / "runs") for s in specs})
        registered = time.perf_counter() - began
        writes = ledger.queries
        mlflow = ClientLedger(uri).client
        for run_id in ids.values():  # two evaluations each, untimed
            mlflow.log_batch(run_id, metrics=[Metric(m, 0.5, 0, step) for m in ("eval/toy24", "eval/toy25")
                                              for step in (0, 10)])  # fmt: skip
        ledger.queries = 0
        began = time.perf_counter()
        records = ledger.runs("bench")
        read = time.perf_counter() - began
        assert len(records) == len(specs) and all(r.step == 10 for r in records)
        if kind == "sql":
            print(f"   sql: register {registered:7.2f} s ({writes} statements), read {read:6.2f} s "
                  f"({ledger.queries} statements)")  # fmt: skip
        else:  # create_run, log_batch, log_text, update_run a run; search_runs, then a history per run and metric
            print(f"client: register {registered:7.2f} s ({4 * len(specs)} calls), read {read:6.2f} s "
                  f"({ledger.queries} calls)")  # fmt: skip
        close_stores()


if __name__ == "__main__":
    main()
