"""A save on the way out (pdmctl/wayout.py): with the profile's `save_grace_s`, SLURM's USR2 before a time
limit lets the trainer finish its step and checkpoint it before the job requeues, so the next attempt
resumes from that step: no step lost, none repeated. On the CI's one-node SLURM with the testbed; the
profile's bounds on the grace without it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdmctl import grid, orchestrate
from pdmctl.executors import ExecutorError, make_executor
from pdmctl.orchestrate import RunState
from tests.conftest import cut_time_limit_to_the_minute_after_next
from tests.test_preflight import needs_slurm
from tests.test_slurm import assert_complete_history, slurm, wait_until, write_profile


def test_a_grace_as_long_as_the_signals_lead_is_refused_in_one_line(tmp_path: Path) -> None:
    """The save must end before the limit: `save_grace_s` at or over `signal_delay_s` is refused."""
    from pdmctl.executors import load_profile

    profile = load_profile(write_profile(tmp_path, signal_delay_s=120, save_grace_s=120))
    with pytest.raises(ExecutorError, match=r"save_grace_s \(120 s\) must be shorter than signal_delay_s \(120 s\)"):
        make_executor(profile).check()


@pytest.mark.slurm
@needs_slurm
@pytest.mark.timeout(900)
def test_at_a_time_limit_the_step_under_way_is_checkpointed_before_the_job_requeues(tmp_path: Path, monkeypatch) -> None:
    """A testbed run checkpointing every 10 steps is held still at the end of step 3 (no checkpoint yet);
    its job's time limit is cut so that SLURM's USR2 comes. With `save_grace_s`, the trainer finishes step 3,
    checkpoints it and the job requeues; the next attempt resumes from step 3 (steps 1-3 are not trained
    again) and the run finishes with every step's metrics once."""
    monkeypatch.setenv("PDMCTL_TOY_HOLD_AT_STEP", "3")  # sbatch passes the environment to the job
    monkeypatch.setenv("PDMCTL_TOY_HOLD_S", "600")
    profile = write_profile(tmp_path, time=10, signal_delay_s=120, save_grace_s=60, max_timeouts=3)
    sweep = "wayout"
    ctx = orchestrate.make_context(profile, f"sqlite:///{tmp_path / 'mlflow.db'}")
    _, (job_id,) = orchestrate.sweep(grid.expand(
        ["backend.steps=12", "backend.checkpoint_every=10", "backend.eval_every=10", "backend.prompts_per_step=8",
         "backend.eval_samples=2", "backend.group_size=4"], None, sweep), ctx)  # fmt: skip
    (view,) = wait_until(ctx, sweep, lambda vs: bool(vs[0].record.run_dir), 120, "the run's directory")
    run_dir = Path(view.record.run_dir)
    attempt_1 = run_dir / "logs" / "attempt-1.log"
    deadline = time.time() + 300
    while not (attempt_1.exists() and "pdmctl: held at step 3" in attempt_1.read_text()):
        assert time.time() < deadline, attempt_1.read_text()[-3000:] if attempt_1.exists() else "no log"
        time.sleep(0.5)
    assert not list((run_dir / "checkpoints").glob("step_*.pt"))  # nothing to resume from but the way out
    cut_time_limit_to_the_minute_after_next(job_id)
    deadline = time.time() + 120
    while "Requeued job" not in attempt_1.read_text():
        assert time.time() < deadline, attempt_1.read_text()[-3000:]
        time.sleep(0.5)
    slurm("scontrol", "update", f"jobid={job_id}", "TimeLimit=10")
    log = attempt_1.read_text()
    assert "pdmctl: SLURM's USR2: the step under way finishes and is checkpointed" in log, log[-3000:]
    assert "pdmctl: checkpointed on the way out at step 3" in log and "DUE TO TIME LIMIT" not in log, log[-3000:]
    (view,) = wait_until(ctx, sweep, lambda vs: vs[0].state not in orchestrate.ACTIVE, 600, "the requeued run")
    assert view.state == RunState.FINISHED and view.record.attempt == 2, view.record
    assert_complete_history(ctx, view.record.run_id, steps=12, eval_every=10)
    second = (run_dir / "logs" / "attempt-2.log").read_text()
    # the second attempt started from step 3's checkpoint: steps 1-3 were not trained again
    assert "pdmctl: resuming from step_00000003.pt (step 3)" in second and "held at step" not in second, second[-3000:]


def test_verls_trainer_saves_the_step_under_way_once_its_job_was_signalled_and_the_job_requeues_on_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The protocol between a job and a trainer in other processes (VeRL's), in one process: before USR2,
    VeRL's "save before the instance expires" check keeps its own answer; after it (a flag in the run
    directory), it is true, so VeRL checkpoints the step under way; the trainer says so once that step's
    checkpoint is the newest (not before), and the job, reading that line with Ray's prefix, requeues
    through the handler it took USR2 from."""
    import os
    import signal

    from pdmctl import wayout

    requeued: list[int] = []
    monkeypatch.setenv(wayout.GRACE_ENV, "30")
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: requeued.append(signum))
    try:
        assert wayout.install(tmp_path)
        check = wayout.save_before_expiry(lambda **kwargs: False, tmp_path)
        assert not check(max_steps_duration=10.0, redundant_time=0) and not wayout.requested()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert wayout.requested() and wayout.flagged(tmp_path) and requeued == []
        assert check(max_steps_duration=10.0, redundant_time=0)  # VeRL saves at the end of this step
        assert not wayout.answer_if_flagged(7, tmp_path, checkpointed=6)  # step 7's checkpoint not written yet
        assert wayout.answer_if_flagged(7, tmp_path, checkpointed=7) and not wayout.flagged(tmp_path)
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith(wayout.SAVED_LINE + "7")
        wayout.requeue_on("\x1b[36m(TaskRunner pid=1)\x1b[0m unrelated line")
        assert requeued == []
        wayout.requeue_on(f"\x1b[36m(TaskRunner pid=1)\x1b[0m {line}\n")
        assert requeued == [signal.SIGUSR2]  # submitit's handler: the requeue, then the job's end
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGUSR2, previous)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        wayout._STATE.update(handler=None, grace=0, since=None, flag=None)


def test_without_a_grace_the_job_keeps_submitits_requeue_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdmctl import wayout

    monkeypatch.delenv(wayout.GRACE_ENV, raising=False)
    assert not wayout.install(None) and not wayout.requested()
