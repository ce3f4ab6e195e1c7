"""The tune driver's own cost: 200 trials on the synthetic backend.

    python bench/tune.py [--trials 200] [--parallel 8] [--workers 2]

What is measured is the driver: each pass's time (ask, register, submit,
reading the ledger and the study, tell), summed over the study and divided by
the trials (CPU time of the driver process; its wall time beside it, which a
loaded machine and the jobs' writes to the same SQLite files inflate), and the SQL statements the driver process issues per trial (its
ledger and its Optuna storage; the jobs' own statements are not counted).
The jobs are ordinary `pdmctl.job` runs in a pool of processes forked after
the imports (a `fork` executor registered here), so that 200 trials take a
minute rather than 200 interpreter starts; the driver cannot tell the
difference, it talks to the executor interface.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import sqlalchemy
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdmctl import job, orchestrate
from pdmctl.backends.synthetic import OPTIMUM, objective
from pdmctl.executors import base as executors
from pdmctl.executors.base import Executor, JobRequest, JobState
from pdmctl.tune import study as tune_study

LIMIT_S = 0.2  # the driver's cost per trial allowed
_POOL: multiprocessing.pool.Pool | None = None
_JOBS: dict[str, multiprocessing.pool.AsyncResult] = {}


def _run_job(job_file: str, log_file: str, job_id: str) -> int:
    os.environ["PDMCTL_JOB_ID"] = job_id
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "w") as log:
        sys.stdout = sys.stderr = log
        return job.run(Path(job_file))


class ForkExecutor(Executor):
    """Jobs as tasks of a pool forked after the imports (this benchmark only)."""

    name = "fork"

    def submit(self, requests: Sequence[JobRequest]) -> list[str]:
        assert _POOL is not None
        ids = []
        for req in requests:
            job_id = _job_id(req.submission)
            _JOBS[job_id] = _POOL.apply_async(_run_job, (str(req.job_file), str(req.log_file), job_id))
            ids.append(job_id)
        return ids

    def states(self, job_ids: Sequence[str]) -> Mapping[str, JobState]:
        out = {}
        for job_id in job_ids:
            result = _JOBS.get(job_id)
            if result is None:
                out[job_id] = JobState.UNKNOWN
            elif not result.ready():
                out[job_id] = JobState.RUNNING
            else:
                out[job_id] = (
                    JobState.COMPLETED if result.successful() and result.get() == 0 else JobState.FAILED
                )
        return out

    def find(self, submissions: Sequence[str]) -> Mapping[str, str]:
        return {s: _job_id(s) for s in submissions if _job_id(s) in _JOBS}

    def cancel(self, job_ids: Sequence[str]) -> None:
        return None


def _job_id(submission: str) -> str:
    """As the local executor: a function of the submission the ledger recorded before the submit."""
    return f"fork-{submission.replace(':', '-')}" if submission else f"fork-{uuid.uuid4().hex[:10]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="job processes")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between the driver's passes")
    args = parser.parse_args()

    global _POOL
    import mlflow  # noqa: F401  (imported before the fork: the jobs start warm)
    import optuna  # noqa: F401

    _POOL = multiprocessing.get_context("fork").Pool(args.workers)
    executors.EXECUTORS["fork"] = "__main__:ForkExecutor"
    work = Path(tempfile.mkdtemp(prefix="pdmctl-bench-tune-"))
    profile = work / "fork.yaml"
    profile.write_text(yaml.safe_dump({"name": "fork", "executor": "fork", "workdir": str(work / "runs")}))
    ctx = orchestrate.make_context(str(profile), f"sqlite:///{work / 'mlflow.db'}")
    overrides = ("backend=synthetic", "model=synthetic", "backend.steps=2", "delta=interval(0.02,0.3)",
                 "backend.lr=tag(log,interval(1e-5,1e-2))")  # fmt: skip
    request = tune_study.Request(overrides=overrides, pruner="median")
    options = tune_study.Options(trials=args.trials, parallel=args.parallel, seed=0, poll_s=args.poll)
    plan = tune_study.check("bench", request, options, ctx, None)
    driver = tune_study.Driver(plan, options, ctx)
    driver.open()

    statements = 0

    def count(*_args) -> None:
        nonlocal statements
        statements += 1

    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", count)
    driver.seconds = driver.cpu_seconds = 0.0
    started = time.perf_counter()
    passes = 0

    def count_pass(_result) -> None:
        nonlocal passes
        passes += 1

    result = driver.run(wait=True, on_pass=count_pass)
    wall = time.perf_counter() - started
    _POOL.close()
    _POOL.join()

    best = driver.study.best_trial
    per_trial = driver.cpu_seconds / args.trials
    print(f"trials: {args.trials} ({', '.join(f'{n} {s.lower()}' for s, n in sorted(result.states.items()))}), "
          f"{args.parallel} in flight, {args.workers} job processes; wall {wall:.1f} s")  # fmt: skip
    print(f"driver cost per trial: {per_trial * 1000:.1f} ms CPU (limit {LIMIT_S * 1000:.0f} ms) "
          f"{'OK' if per_trial <= LIMIT_S else 'OVER'}; {driver.seconds / args.trials * 1000:.1f} ms wall "
          f"in {passes} passes (waits on the jobs' SQLite writes included)")  # fmt: skip
    print(f"store statements per trial (driver: ledger + Optuna): {statements / args.trials:.1f}")
    print(f"best: {best.value:.4f} at delta={best.params['delta']:.4f} lr={best.params['backend.lr']:.2e} "
          f"(optimum {objective(**OPTIMUM):.1f} at delta={OPTIMUM['delta']}, lr={OPTIMUM['lr']:.2e})")  # fmt: skip
    print(f"workdir: {work}")


if __name__ == "__main__":
    main()
