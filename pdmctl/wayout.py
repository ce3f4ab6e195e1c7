"""A save on the way out: when SLURM signals a job before its time limit or a preemption (USR2 to the batch
step, `signal_delay_s` ahead), the trainer finishes the step it is in and writes a checkpoint, and only then
does the job requeue; the next attempt resumes from that step, none redone.

The SLURM job (`executors.slurm.PdmctlJob`) calls `install(run_dir)` where the profile gives a grace
(`save_grace_s`, exported as PDMCTL_SAVE_GRACE_S; 0: requeue at once, as submitit does). USR2 then sets
`requested()`, leaves a flag file in the run directory for a trainer in other processes (VeRL's), and arms a
timer of the grace. A trainer in this process (the testbed) calls `checkpoint_and_requeue_if_asked` at the end
of each step: it saves, then requeues through submitit's own handler (which asks the scheduler for the
requeue and ends the job). VeRL's trainer saves at the end of its step (the flag makes VeRL's own
"save before the instance expires" check true) and prints `SAVED_LINE`, on which the job requeues
(`requeue_on`). A trainer that has not checkpointed within the grace is requeued as it stands when the timer
fires, losing the steps since its last checkpoint, as without a grace.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GRACE_ENV = "PDMCTL_SAVE_GRACE_S"
FLAG = "save-and-requeue"  # in the run directory: the job was signalled; a trainer elsewhere saves its step
SAVED_LINE = "pdmctl: checkpointed on the way out at step "

_STATE: dict[str, Any] = {"handler": None, "grace": 0, "since": None, "flag": None}


def grace_seconds() -> int:
    try:
        return max(0, int(os.environ.get(GRACE_ENV, "0")))
    except ValueError:
        return 0


def install(run_dir: Path | None = None) -> bool:
    """Take over this process's USR2 (submitit's handler kept for the requeue) where a grace is given; whether
    it did."""
    grace = grace_seconds()
    original = signal.getsignal(signal.SIGUSR2)
    if not grace or not callable(original):
        return False
    _STATE.update(handler=original, grace=grace, since=None, flag=Path(run_dir) / FLAG if run_dir else None)
    if _STATE["flag"] is not None:
        _STATE["flag"].unlink(missing_ok=True)  # an earlier attempt's
    signal.signal(signal.SIGUSR2, _on_signal)
    signal.signal(signal.SIGALRM, _on_grace)
    return True


def _on_signal(signum: int, frame: Any) -> None:
    if _STATE["since"] is not None:
        return
    _STATE["since"] = time.monotonic()
    print(f"pdmctl: SLURM's USR2: the step under way finishes and is checkpointed, then the job requeues "
          f"(within {_STATE['grace']} s)", flush=True)  # fmt: skip
    if _STATE["flag"] is not None:
        try:
            _STATE["flag"].touch()
        except OSError as exc:
            print(f"pdmctl: the trainer cannot be told to save ({exc}): requeueing as it stands", flush=True)
            requeue()
            return
    signal.alarm(int(_STATE["grace"]))


def _on_grace(signum: int, frame: Any) -> None:
    print(f"pdmctl: no checkpoint within {_STATE['grace']} s of SLURM's USR2: the job requeues as it stands",
          flush=True)  # fmt: skip
    requeue()


def requested() -> bool:
    return _STATE["since"] is not None


def requeue() -> None:
    """Requeue now through submitit's handler (it asks the scheduler for the requeue and ends the job)."""
    signal.alarm(0)
    if _STATE["flag"] is not None:
        _STATE["flag"].unlink(missing_ok=True)
    handler = _STATE["handler"]
    if callable(handler):
        handler(signal.SIGUSR2, None)


def checkpoint_and_requeue_if_asked(step: int, save: Callable[[], None]) -> None:
    """At the end of step `step` of a trainer in this process: where the job was signalled, `save` (this step's
    checkpoint), then requeue."""
    if not requested():
        return
    save()
    print(f"{SAVED_LINE}{step}, {time.monotonic() - _STATE['since']:.0f} s after the signal; requeueing",
          flush=True)  # fmt: skip
    requeue()


def requeue_on(line: str) -> None:
    """The job's reading of its trainer's output: the trainer's checkpoint on the way out ends the wait."""
    if requested() and SAVED_LINE in line:  # Ray prefixes a worker's lines with its name
        requeue()


# --- the trainer's side, in another process (VeRL) ---------------------------------------------------


def flagged(run_dir: Path) -> bool:
    """Whether the job of `run_dir` was signalled and waits for the trainer's checkpoint."""
    return (Path(run_dir) / FLAG).exists()


def unflag(run_dir: Path) -> None:
    """The trainer answered the flag (its line is on the way to the job)."""
    (Path(run_dir) / FLAG).unlink(missing_ok=True)


def save_before_expiry(original: Callable[..., bool], run_dir: Path) -> Callable[..., bool]:
    """VeRL's check for a checkpoint before its instance expires (`should_save_ckpt_esi`), true too once the job of
    `run_dir` was signalled: VeRL then saves at the end of the step under way."""

    def check(*args: Any, **kwargs: Any) -> bool:
        return flagged(run_dir) or bool(original(*args, **kwargs))

    return check


def answer_if_flagged(step: int, run_dir: Path, checkpointed: int | None) -> bool:
    """The VeRL trainer after logging `step`: where its job was signalled and the newest checkpoint is this
    step's, say so (the job requeues on the line) and return True."""
    if not flagged(run_dir) or checkpointed != step:
        return False
    print(f"{SAVED_LINE}{step}; requeueing", flush=True)
    unflag(run_dir)
    return True
