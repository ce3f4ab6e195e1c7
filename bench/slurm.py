"""Submitting a 1,000-run grid to the test SLURM and reading its state back.

Targets: `pdmctl sweep` of 1,000 runs <= 15 s and <= 3 `sbatch` calls; `pdmctl status` over them
<= 3 s with one `sacct` call. Scheduler commands are counted by wrapper scripts put first on PATH
that log each call and run the real command. The jobs are submitted held (`--hold`), so nothing
trains, and cancelled at the end. Each command runs as a user runs it (a fresh `pdmctl` process,
its imports included) against an existing tracking store; the parts are then timed in this
process, imports excluded.

    python bench/slurm.py [--runs 1000] [--keep DIR]   (needs .ci/slurm_up.sh's cluster)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

COUNTED = ("sbatch", "sacct", "squeue", "scancel", "scontrol", "sinfo")
PDMCTL = [sys.executable, "-m", "pdmctl.cli"]


def wrap_commands(bin_dir: Path, log: Path) -> dict[str, str]:
    """Wrapper scripts that log `name args` and exec the real command; returns the env that uses them."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in COUNTED:
        real = shutil.which(name)
        if real is None:
            sys.exit(f"{name} not found: start the test cluster with .ci/slurm_up.sh")
        script = bin_dir / name
        script.write_text(f'#!/bin/bash\necho "{name} $*" >> {log}\nexec {real} "$@"\n')
        script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def calls(log: Path) -> Counter:
    return Counter(line.split()[0] for line in log.read_text().splitlines()) if log.exists() else Counter()


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--keep", type=Path, help="work here and keep it (default: a temporary directory)")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="pdmctl-bench-slurm-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "scheduler-calls.log"
    env = wrap_commands(work / "bin", log)
    profile = work / "bench.yaml"
    profile.write_text(yaml.safe_dump({
        "name": "slurm-bench", "executor": "slurm", "max_concurrent": 8, "workdir": str(work / "runs"),
        "partition": "debug", "time": 10, "cpus_per_task": 1, "mem_gb": 1, "job_name": "pdmctl-bench",
        "sbatch": ["--hold"],  # queued, never started: the benchmark measures the scheduler round trips
    }))  # fmt: skip
    uri = f"sqlite:///{work / 'mlflow.db'}"
    common = ["--cluster", str(profile), "--tracking-uri", uri]
    sweep = f"bench{int(time.time())}"
    rows: list[tuple[str, str, str, str]] = []
    os.environ["PATH"] = env["PATH"]
    from pdmctl import grid, orchestrate
    from pdmctl.executors import JobRequest
    from pdmctl.ledger import open_ledger

    try:
        # 0. the tracking store exists before a sweep (creating MLflow's schema is once per store)
        t0 = time.perf_counter()
        open_ledger(uri)
        rows.append(("create the MLflow store (once)", f"{time.perf_counter() - t0:.2f} s", "none", ""))
        # 1. the CLI, as a user runs it: a fresh process, imports and grid expansion included
        log.unlink(missing_ok=True)
        t_sweep = timed(
            [*PDMCTL, "sweep", f"seeds={args.runs}", "backend.steps=1", "--name", sweep, *common], env, work
        )
        c_sweep = calls(log)
        log.unlink(missing_ok=True)
        t_status = timed([*PDMCTL, "status", sweep, *common], env, work)
        c_status = calls(log)
        rows += [
            (
                f"pdmctl sweep ({args.runs} runs, CLI)",
                f"{t_sweep:.2f} s",
                _fmt(c_sweep),
                "<= 15 s, <= 3 sbatch",
            ),
            ("pdmctl status (CLI)", f"{t_status:.2f} s", _fmt(c_status), "<= 3 s, 1 sacct"),
        ]
        # the same status in a fresh process, without rendering the 1,000-row table (rich's share)
        log.unlink(missing_ok=True)
        script = (f"from pdmctl import cli, orchestrate; ctx = orchestrate.make_context({str(profile)!r}, {uri!r}); "
                  f"orchestrate.status(ctx, {sweep!r})")  # fmt: skip
        t_bare = timed([sys.executable, "-c", script], env, work)
        rows.append(("  the same, the table not rendered", f"{t_bare:.2f} s", _fmt(calls(log)), ""))
        # 2. the parts, in this process: grid, orchestrate.sweep (ledger + executor), the executor alone, status
        ctx = orchestrate.make_context(str(profile), uri)
        t0 = time.perf_counter()
        specs = grid.expand([f"seeds={args.runs}", "backend.steps=2"], None, f"{sweep}b")
        rows.append(
            (f"grid.expand ({len(specs)} runs, Hydra)", f"{time.perf_counter() - t0:.2f} s", "none", "")
        )
        log.unlink(missing_ok=True)
        t0 = time.perf_counter()
        _, job_ids = orchestrate.sweep(specs, ctx)
        rows.append(
            (
                f"orchestrate.sweep ({len(job_ids)} runs)",
                f"{time.perf_counter() - t0:.2f} s",
                _fmt(calls(log)),
                "",
            )
        )
        executor = orchestrate.make_executor(ctx.profile)
        requests = [
            JobRequest(f"r{i}", f"k{i}", work / f"j{i}.json", work / f"l{i}.log", 1) for i in range(args.runs)
        ]
        log.unlink(missing_ok=True)
        t0 = time.perf_counter()
        executor.submit(requests)
        rows.append(
            (
                f"SlurmExecutor.submit ({args.runs} requests)",
                f"{time.perf_counter() - t0:.2f} s",
                _fmt(calls(log)),
                "",
            )
        )
        log.unlink(missing_ok=True)
        t0 = time.perf_counter()
        views = orchestrate.status(ctx, f"{sweep}b")
        queued = sum(v.state == orchestrate.RunState.QUEUED for v in views)
        rows.append(
            (
                f"orchestrate.status ({queued} queued)",
                f"{time.perf_counter() - t0:.2f} s",
                _fmt(calls(log)),
                "",
            )
        )
    finally:
        log.unlink(missing_ok=True)
        t0 = time.perf_counter()
        subprocess.run(
            [*PDMCTL, "cancel", "--yes", *common], env=env, cwd=work, capture_output=True, check=False
        )
        rows.append(
            ("pdmctl cancel (both sweeps, CLI)", f"{time.perf_counter() - t0:.2f} s", _fmt(calls(log)), "")
        )
        subprocess.run(
            ["scancel", "--name=pdmctl-bench"], check=False
        )  # the executor-only array, and any left

    table = Table(title=f"SLURM executor: {args.runs}-run grid on the test cluster ({work})")
    for col in ("operation", "wall time", "scheduler calls", "target"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    ok = t_sweep <= 15 and c_sweep["sbatch"] <= 3 and t_status <= 3 and c_status["sacct"] == 1
    Console().print(f"targets {'met' if ok else 'MISSED'}: sweep {t_sweep:.2f} s with {c_sweep['sbatch']} sbatch; "
                    f"status {t_status:.2f} s with {c_status['sacct']} sacct", highlight=False)  # fmt: skip
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def _fmt(counter: Counter) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(counter.items())) or "none"


if __name__ == "__main__":
    main()
