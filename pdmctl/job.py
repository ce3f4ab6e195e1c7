"""What runs inside a job: job file -> RunSpec -> backend -> ledger.

    python -m pdmctl.job JOB_FILE

The job file (written by the orchestrator next to the run's checkpoints) names
the MLflow run, the tracking URI, the run directory and the attempt. The job
attaches to that run, hands the backend a tracker that logs into it, and sets
the run's final status. A SIGTERM (cancel, or the scheduler ending the job)
marks the run KILLED; a crash marks it FAILED with the error as its reason; a
SIGKILL leaves it RUNNING, and `pdmctl status` finds it lost. A run its declared
collapse rule ends (pdmctl.budget.collapse) is KILLED with the rule's reason: stopped.
An attempt that lost a node (`backends.base.NodeLost`) is FAILED too, and under SLURM
the job asks for its own next attempt (`requeue_after_node_loss`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from pdmctl.backends.base import NodeLost
from pdmctl.backends.registry import flat_config, get_backend
from pdmctl.budget.collapse import Collapsed, rule_tracker
from pdmctl.ledger import FAILED, FINISHED, KILLED, RunLogger
from pdmctl.preflight import STARTED_ENV
from pdmctl.spec import RunSpec
from pdmctl.steplines import StepLines, metrics_text
from pdmctl.tune.trial import Pruned, trial_tracker


@dataclass(frozen=True)
class JobFile:
    run_id: str
    tracking_uri: str
    spec_json: str
    run_dir: str
    attempt: int
    executor: str
    submission: str = ""  # "token:index:attempt": the ledger's intent this job serves

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.__dict__, indent=1))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def read(cls, path: Path) -> JobFile:
        return cls(**json.loads(Path(path).read_text()))


class Cancelled(BaseException):
    """Raised in the job when it receives SIGTERM."""


def _on_sigterm(signum, frame):
    raise Cancelled(f"signal {signum}")


def job_id_from_env() -> str:
    if "PDMCTL_JOB_ID" in os.environ:
        return os.environ["PDMCTL_JOB_ID"]
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '0')}"
    return os.environ.get("SLURM_JOB_ID", f"pid-{os.getpid()}")


def run(job_file: Path) -> int:
    job = JobFile.read(job_file)
    logger = RunLogger(job.tracking_uri, job.run_id)
    try:  # a run that cannot even start says why in the ledger, not only in its log
        spec = RunSpec.from_json(job.spec_json)
        threads = int(os.environ.get("PDMCTL_NUM_THREADS", "0"))
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        attempt = job.attempt + int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    except Exception as exc:
        traceback.print_exc()
        logger.finish(FAILED, reason=f"job start-up: {type(exc).__name__}: {exc}".splitlines()[0])
        return 1
    signal.signal(signal.SIGTERM, _on_sigterm)
    # the backends' time to their first step (pdmctl.preflight)
    os.environ[STARTED_ENV] = f"{time.time():.3f}"
    logger.start(attempt=attempt, job_id=job_id_from_env(), executor=job.executor, submission=job.submission)
    print(f"pdmctl job: run {spec.key} ({spec.summary}) attempt {attempt} in {job.run_dir}", flush=True)
    try:
        backend = get_backend(spec.backend)
        record_provenance(logger, spec, backend, job, attempt)
        with StepLines(rule_tracker(trial_tracker(logger, Path(job.run_dir)), spec.config)) as tracker:
            final = backend.run(flat_config(spec.config), Path(job.run_dir), tracker)  # a line per step
    except Collapsed as exc:  # its declared collapse rule ended it: final, like a finished run
        logger.finish(KILLED, reason=str(exc))
        print(f"pdmctl job: {exc}", flush=True)
        return 0
    except Pruned as exc:  # a tune trial's pruner stopped it: an ending, not a failure to resume
        logger.finish(KILLED, reason=f"pruned at {exc}")
        print(f"pdmctl job: pruned ({exc})", flush=True)
        return 0
    except Cancelled as exc:
        logger.finish(KILLED, reason=f"cancelled ({exc})")
        print(f"pdmctl job: cancelled ({exc})", flush=True)
        return 143
    except NodeLost as exc:  # the run is sound: FAILED until its next attempt, which the job asks for
        reason = f"node lost: {exc}".splitlines()[0]
        logger.finish(FAILED, reason=reason)
        print(f"pdmctl job: {reason}", flush=True)
        print(f"pdmctl job: {requeue_after_node_loss(Path(job.run_dir))}", flush=True)
        return 1
    except Exception as exc:
        traceback.print_exc()
        logger.finish(FAILED, reason=f"{type(exc).__name__}: {exc}".splitlines()[0])
        return 1
    logger.finish(FINISHED)
    print(f"pdmctl job: finished: {metrics_text(final)}", flush=True)
    return 0


def record_provenance(logger: RunLogger, spec: RunSpec, backend, job: JobFile, attempt: int) -> None:
    """Where this attempt's numbers come from (pdmctl.provenance), into the run's tags; a store that
    refuses them is said in the log, and the run goes on."""
    from pdmctl import provenance

    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    try:
        fields = provenance.collect(spec.config, lambda: backend.provenance(flat_config(spec.config), Path(job.run_dir)))  # fmt: skip
        logger.record_provenance(attempt, job_id_from_env(), fields, executor=job.executor, requeues=restarts)
    except Exception as exc:
        print(f"pdmctl job: provenance not recorded ({type(exc).__name__}: {exc})".splitlines()[0], flush=True)  # fmt: skip


MAX_NODE_LOSSES_ENV = "PDMCTL_MAX_NODE_LOSSES"  # the SLURM profile's max_node_losses
DEFAULT_MAX_NODE_LOSSES = 3


def requeue_after_node_loss(run_dir: Path) -> str:
    """Under SLURM, requeue this job (`scontrol requeue`: the next attempt resumes from the run's checkpoint)
    while the run has lost fewer nodes than the profile's `max_node_losses` (counted in run_dir/node-losses,
    one line per loss, across attempts and jobs). SLURM requeues a job by itself only for a node it has seen
    fail; a node whose Ray step was ended, or that came back before SLURM saw it gone, is found by the job
    alone. Returns what was done, in one line; the run stays FAILED where no requeue was asked for."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not requeued: not a SLURM job (pdmctl resume starts the next attempt)"
    try:
        limit = int(os.environ.get(MAX_NODE_LOSSES_ENV, DEFAULT_MAX_NODE_LOSSES))
    except ValueError:
        limit = DEFAULT_MAX_NODE_LOSSES
    counter = run_dir / "node-losses"
    try:
        with counter.open("a") as fh:
            fh.write(f"{job} {os.environ.get('SLURM_RESTART_COUNT', '0')}\n")
        losses = len(counter.read_text().splitlines())
    except OSError as exc:
        return f"not requeued: the count of lost nodes is not writable ({exc})"
    if losses > limit:
        return (f"not requeued: the run has lost {losses} node(s), more than max_node_losses={limit} "
                "(pdmctl resume starts the next attempt)")  # fmt: skip
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not requeued: scontrol requeue {job}: {exc}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return f"not requeued: scontrol requeue {job}: {said[-1] if said else f'exit {done.returncode}'}"
    return f"requeued job {job} (node loss {losses} of at most {limit}): the next attempt resumes from the checkpoint"


def main() -> None:
    if len(sys.argv) != 2:
        print("usage: python -m pdmctl.job JOB_FILE", file=sys.stderr)
        sys.exit(2)
    code = run(Path(sys.argv[1]))
    exit_file = os.environ.get("PDMCTL_EXIT_FILE")
    if exit_file:  # the local executor reads it when the worker that started this job has died since
        Path(exit_file).write_text(str(code))
    sys.exit(code)


if __name__ == "__main__":
    main()
