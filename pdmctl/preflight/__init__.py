"""The preflight: one short job per distinct setting of a sweep, before the sweep's array goes out.

A preflight run is an ordinary run of a sweep named `<sweep>.preflight` (so that the sweep's `status`,
`report` and `seeds` leave it out) whose config is the setting's own with a few steps, a checkpoint after
each, and no held-out evaluation. Its run directory's parent holds `preflight.json`: after the checkpoint
of step `requeue_at_step`, on its first attempt, the job asks SLURM for the signal it sends before a time
limit (USR2 to the batch step), and so requeues and resumes through the path a real run takes when its
time runs out; the resumed attempt trains the remaining steps from that checkpoint (through the
checkpoint guard, on the VeRL engine).

This module is what the jobs import (`requeue_if_asked`, light: no CLI); the command is `preflight.cli`,
the per-setting verdicts `preflight.summary`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

SUFFIX = ".preflight"
MARK = "preflight.json"  # in the run directory's parent (the key's directory): {"requeue_at_step": N}
STEPS = 3
REQUEUE_AT_STEP = 1
WAIT_FOR_SIGNAL_S = 600.0  # the job's wait for SLURM's USR2 to requeue it, before it says it never came


STARTED_ENV = "PDMCTL_JOB_STARTED"  # the attempt's start (epoch seconds), set by the job for its processes
FIRST_STEP = "pdmctl/first_step_s"  # seconds from an attempt's start to its first step, logged at that step
STEP = "timing_s/step"  # a step's seconds (VeRL's own metric; the testbed logs it in a preflight)


class PreflightError(RuntimeError):
    """A preflight job that could not requeue itself; the message is one line."""


def preflight_sweep(sweep: str) -> str:
    return sweep if sweep.endswith(SUFFIX) else f"{sweep}{SUFFIX}"


def requeue_at(run_dir: Path) -> int | None:
    """The step after whose checkpoint this run's first attempt requeues itself (None: not a preflight run,
    or a mark that cannot be read, which never stops a run)."""
    try:
        data = json.loads((Path(run_dir).parent / MARK).read_text())
        step = data.get("requeue_at_step") if isinstance(data, dict) else None
        return step if isinstance(step, int) and not isinstance(step, bool) and step >= 1 else None
    except (OSError, ValueError):
        return None


def since_start() -> float | None:
    """Seconds since this attempt's job started (None outside a job)."""
    try:
        return max(0.0, time.time() - float(os.environ[STARTED_ENV]))
    except (KeyError, ValueError):
        return None


def timings(step_s: float | None, first: bool) -> dict[str, float]:
    """A step's times as metrics: its seconds and, at an attempt's first step, the seconds to it."""
    out = {} if step_s is None else {STEP: step_s}
    started = since_start() if first else None
    if started is not None:
        out[FIRST_STEP] = started
    return out


def slurm_job() -> str | None:
    """This job's id as `scancel` takes it (an array task: ARRAY_TASK), or None outside SLURM."""
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID") or None


def requeue_if_asked(step: int, fresh_run: bool, run_dir: Path, *, wait_s: float = WAIT_FOR_SIGNAL_S) -> None:
    """After the checkpoint of `step`: where this is a preflight run's first attempt and `step` its requeue
    step, ask SLURM for the batch step's USR2 (what it sends `signal_delay_s` before a time limit) and wait
    for the job's handler to requeue it; the wait ends the process. Outside SLURM: PreflightError."""
    if not fresh_run or requeue_at(run_dir) != step:
        return
    job = slurm_job()
    if job is None:
        raise PreflightError("preflight: a preflight run requeues itself through SLURM, and this job is not "
                             "under SLURM")  # fmt: skip
    print(f"pdmctl: preflight: step {step} checkpointed; requeueing through SLURM's time-limit signal "
          f"(USR2 to job {job}'s batch step), as a run at its time limit does", flush=True)  # fmt: skip
    done = subprocess.run(["scancel", "--batch", "--signal=USR2", job], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise PreflightError(f"preflight: scancel --signal=USR2 {job} failed: {said[-1] if said else done.returncode}")
    from pdmctl import wayout

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:  # the handler requeues the job and ends this process meanwhile
        if wayout.requested():  # a job that saves on the way out: this step's checkpoint is written
            wayout.requeue()
        elif wayout.flagged(run_dir):  # the same, told to a trainer in another process (VeRL's)
            print(f"{wayout.SAVED_LINE}{step} (its checkpoint was written before the signal)", flush=True)
            wayout.unflag(run_dir)
        time.sleep(1.0)
    raise PreflightError(f"preflight: job {job} was not requeued within {wait_s:.0f} s of its USR2: the "
                         "profile's job must take the batch step's signal (--signal=B:USR2)")  # fmt: skip
