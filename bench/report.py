"""The full report on a large sweep: target <= 10 s.

2,000 runs (2 precisions × 5 masks × 5 δ × 8 K × 5 seeds) in a SQLite MLflow store, each with 100
logged evaluation points (eval/toy24 and eval/toy25) and the four training-dynamics metrics at the same
steps: 1.2 M metric rows. The store is made once (registered by the ledger, metric rows inserted in bulk)
and kept; the timed part opens the ledger, reads the sweep, computes every table, interval, comparison
and curve band, draws the figures and writes Markdown, CSV, LaTeX and the HTML page. It prints the time
(and the import time of the report's modules, which a fresh `pdmctl report` also pays) and the number of
statements the ledger sent to the store.

    python bench/report.py [--store /tmp/pdmctl-bench-report/mlflow.db] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_report_synthetic import SyntheticSweep, finish, make_sweep, write_points

SWEEP = "bench"
GRID = ["mask=pdm_agg,pdm_uni,pdm_exact,dppo_topk_kl,dppo_topk_tv", "precision=bf16,fp8_rollout",
        "delta=0.05,0.1,0.15,0.2,0.3", "k=5,10,20,30,50,75,100,150", "seed=0,1,2,3,4"]  # fmt: skip
EVAL_POINTS = 100
STEP_EVERY = 10
METRICS = ("eval/toy24", "eval/toy25", "train/reward", "train/response_length", "train/ppo_kl", "train/mask_frac")


def points(sweep: SyntheticSweep) -> Iterator[tuple[str, str, int, float]]:
    rng = np.random.default_rng(0)
    steps = np.arange(EVAL_POINTS) * STEP_EVERY
    progress = 1 - np.exp(-steps / 300)
    for run_id, spec in sweep.specs.items():
        skill = 0.03 * ("pdm" in spec.config["mask"]["name"]) + 0.01 * rng.standard_normal()
        curves = {
            "eval/toy24": 0.2 + (0.25 + skill) * progress,
            "eval/toy25": 0.18 + (0.22 + skill) * progress,
            "train/reward": 0.25 + 0.3 * progress,
            "train/response_length": 3.5 + 0.5 * progress,
            "train/ppo_kl": 0.03 * np.exp(-steps / 100),
            "train/mask_frac": 0.05 * np.exp(-steps / 200),
        }
        for key in METRICS:
            values = curves[key] + 0.01 * rng.standard_normal(EVAL_POINTS)
            yield from ((run_id, key, int(s), float(v)) for s, v in zip(steps, values, strict=True))


def make_store(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sweep = make_sweep(f"sqlite:///{path}", SWEEP, GRID)
    n = write_points(sweep.ledger, points(sweep))
    finish(sweep.ledger, list(sweep.specs))
    print(f"made the store: {len(sweep.specs)} runs, {n:,} metric rows in {time.perf_counter() - t0:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, default=Path(tempfile.gettempdir()) / "pdmctl-bench-report" / "mlflow.db")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: a temporary one)")
    args = ap.parse_args()
    if not args.store.exists():
        make_store(args.store)

    t0 = time.perf_counter()
    from rich.console import Console

    from pdmctl.ledger import SqlLedger
    from pdmctl.report.build import build_report
    from pdmctl.report.definition import load_definition
    from pdmctl.report.tables import comparison_table, excluded_table, results_table, to_rich
    from pdmctl.report.write import write_report

    t1, cpu1 = time.perf_counter(), time.process_time()
    ledger = SqlLedger(f"sqlite:///{args.store}")
    report = build_report(ledger, [SWEEP], load_definition("default"))
    t2 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        written = write_report(report, args.out or Path(tmp))
        console = Console(file=io.StringIO(), width=200)
        for table in (results_table(report), comparison_table(report), excluded_table(report)):
            console.print(to_rich(table))
        t3, cpu3 = time.perf_counter(), time.process_time()
        size = sum(p.stat().st_size for p in written)
    runs = sum(len(r.seeds) for r in report.rows)
    print(f"report on {runs} runs × {EVAL_POINTS} evaluation points, {len(report.rows)} rows, "
          f"{len(report.comparisons)} comparisons, {sum(1 for p in written if p.suffix == '.png')} figures, "
          f"{len(written)} files ({size / 1e6:.1f} MB)")  # fmt: skip
    print(f"time: {t3 - t1:.2f} s (read + statistics {t2 - t1:.2f} s, figures + files + terminal tables "
          f"{t3 - t2:.2f} s; CPU {cpu3 - cpu1:.2f} s, more than the wall time where numpy uses a second core, "
          f"less where other processes share them); importing the report's modules {t1 - t0:.2f} s; "
          f"target <= 10 s")  # fmt: skip
    print(f"store queries: {ledger.queries}")


if __name__ == "__main__":
    main()
