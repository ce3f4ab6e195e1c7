"""The orchestrator at scale: planning, submitting and reading back a large sweep.

1. Expand a 1,000-run grid and register it in a fresh SQLite ledger (no training): target <= 10 s.
2. `pdmctl status` over those 1,000 runs, as a user runs it (a new process, imports included),
   with half of them finished and carrying metrics: target <= 3 s, and the number of store
   statements it issued (bulk queries, not one per run).

    python bench/sweep.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

GRID = [
    "mask=pdm_agg,pdm_uni,pdm_exact,dppo_topk_kl",
    "delta=0.05,0.1,0.15,0.2,0.25",
    "k=10,20,30,40,50",
    "seeds=10",
]
REGISTER_PROBE = """
import json, sys
from pathlib import Path
sys.path.insert(0, {bench!r})
from sweep import register
print("REGISTER", json.dumps(register(Path({tmp!r}))))
"""
STATUS_PROBE = """
import sys, time
t0 = time.perf_counter()
from pdmctl import ledger as L
count = {"n": 0}
orig = L.SqlLedger.__init__
def patched(self, uri):
    orig(self, uri)
    from sqlalchemy import event
    event.listen(self.engine, "before_cursor_execute", lambda *a, **k: count.__setitem__("n", count["n"] + 1))
L.SqlLedger.__init__ = patched
from pdmctl.cli import app
try:
    app(["status", "bench"], standalone_mode=False)
finally:
    print(f"STATUS_QUERIES {count['n']}", file=sys.stderr)
"""


def register(db_dir: Path) -> tuple[float, float, float, int]:
    """(store creation, expansion, registration) seconds, in a fresh process's first call."""
    from pdmctl.grid import expand
    from pdmctl.ledger import open_ledger

    t0 = time.perf_counter()
    open_ledger(f"sqlite:///{db_dir / 'mlflow.db'}").engine.dispose()  # one-time: MLflow creates its schema
    t1 = time.perf_counter()
    specs = expand(GRID, sweep="bench")
    t2 = time.perf_counter()
    ledger = open_ledger(f"sqlite:///{db_dir / 'mlflow.db'}")
    ids = ledger.register(specs, {s.key: str(db_dir / s.key) for s in specs})
    t3 = time.perf_counter()
    assert len(ids) == 1000, len(ids)
    _finish_half(ledger, list(ids.values()))
    return t1 - t0, t2 - t1, t3 - t2, len(specs)


def _finish_half(ledger, run_ids: list[str]) -> None:
    """Half the runs finished, with a latest reward and avg@16, as a status table would meet them."""
    half = run_ids[: len(run_ids) // 2]
    ledger.set_status(half, "FINISHED")
    rows = [dict(key=k, value=0.5, timestamp=0, step=60, is_nan=False, run_uuid=r)
            for r in half for k in ("train/reward", "eval/toy24", "eval/toy25")]  # fmt: skip
    with ledger.engine.begin() as conn:
        conn.execute(ledger.t["latest_metrics"].insert(), rows)
        conn.execute(ledger.t["metrics"].insert(), rows)


def status_once(cwd: Path) -> tuple[float, int]:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}", "COLUMNS": "200"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", STATUS_PROBE], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or "1000 runs" not in proc.stdout.replace("500 finished, 500 not started", "1000 runs"):
        raise SystemExit(f"status failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    queries = int(proc.stderr.rsplit("STATUS_QUERIES", 1)[1].split()[0])
    return wall, queries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    create_s, expand_s, register_s, status_s, queries = [], [], [], [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            # a new process each time, so that imports are paid as a user pays them
            code = REGISTER_PROBE.format(bench=str(Path(__file__).parent), tmp=tmp)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            c, e, r, n = json.loads(out.rsplit("REGISTER", 1)[1])
            create_s.append(c)
            expand_s.append(e)
            register_s.append(r)
            wall, q = status_once(Path(tmp))
            status_s.append(wall)
            queries.append(q)
    med = statistics.median
    table = Table(title=f"orchestrator: {n}-run grid, SQLite ledger, median of {args.repeats}")
    for col in ("measure", "seconds", "target", "ratio to target"):
        table.add_column(col, justify="right")
    rows = [
        ("create a new store (once per store: MLflow's schema)", med(create_s), None),
        ("expand grid (first call: imports included)", med(expand_s), None),
        ("register 1,000 runs in the ledger", med(register_s), None),
        ("expand + register", med(e + r for e, r in zip(expand_s, register_s, strict=True)), 10.0),
        ("pdmctl status over 1,000 runs (new process)", med(status_s), 3.0),
    ]
    for name, secs, target in rows:
        table.add_row(name, f"{secs:.2f}", f"<= {target:g}" if target else "", f"{secs / target:.2f}" if target else "")
    Console().print(table)
    print(f"store statements issued by one `pdmctl status`: {max(queries)} (for 1,000 runs)")


if __name__ == "__main__":
    main()
