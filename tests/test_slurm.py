"""The SLURM executor on a real cluster (.ci/slurm_up.sh: one node, fake GPUs, slurmdbd accounting) and
the PostgreSQL-backed MLflow server (.ci/mlflow_server_up.sh).

Each test runs short toy trainings (a few seconds of steps after ~10 s of imports) in its own
directory and its own SQLite ledger, except the server test, which logs over HTTP.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from pdmctl import grid, orchestrate
from pdmctl.budget.cost import spent_seconds
from pdmctl.executors import JobRequest, JobState, make_executor
from pdmctl.ledger import LedgerError, SqlLedger, open_ledger
from pdmctl.orchestrate import RunState, RunView
from tests.conftest import cut_time_limit_to_the_minute_after_next

REPO = Path(__file__).resolve().parents[1]
# a short toy run: eval at 0, 2, 4, ...; a checkpoint every 2 steps; tiny batches
TOY = ["backend.eval_every=2", "backend.checkpoint_every=2", "backend.prompts_per_step=8",
       "backend.eval_samples=2", "backend.group_size=4"]  # fmt: skip


def _slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        not _slurm_answers(), reason="no SLURM answering here (start it with .ci/slurm_up.sh)"
    ),
]


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def write_profile(tmp_path: Path, name: str = "slurm-test", max_concurrent: int = 6, **options) -> str:
    data = {"name": name, "executor": "slurm", "max_concurrent": max_concurrent, "workdir": str(tmp_path / "runs"),
            "partition": "debug", "time": 10, "cpus_per_task": 1, "mem_gb": 1, "signal_delay_s": 30,
            "job_name": f"pdmctl-test-{uuid.uuid4().hex[:8]}", **options}  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def start_sweep(tmp_path: Path, overrides: Sequence[str], profile: str, uri: str | None = None):
    name = f"t{uuid.uuid4().hex[:8]}"
    specs = grid.expand([*TOY, *overrides], None, name)
    ctx = orchestrate.make_context(profile, uri or f"sqlite:///{tmp_path / 'mlflow.db'}")
    _, job_ids = orchestrate.sweep(specs, ctx)
    return ctx, name, job_ids


def wait_until(
    ctx, sweep: str, done: Callable[[list[RunView]], bool], timeout: float, what: str
) -> list[RunView]:
    deadline = time.time() + timeout
    while True:
        views = orchestrate.status(ctx, sweep)
        if views and done(views):
            return views
        if time.time() > deadline:
            table = "; ".join(f"{v.key} {v.state} job={v.record.job_id if v.record else None} "
                              f"step={v.record.step if v.record else None}" for v in views)  # fmt: skip
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}: {table}\n{_job_logs(ctx)}")
        time.sleep(1.0)


def all_in(*states: RunState) -> Callable[[list[RunView]], bool]:
    return lambda views: all(v.state in states for v in views)


def wait_for_step(ctx, sweep: str, step: int, timeout: float = 120) -> RunView:
    views = wait_until(ctx, sweep, lambda vs: (vs[0].record.step or 0) >= step, timeout, f"step {step}")
    return views[0]


def wait_for_job_states(
    executor, job_ids: Sequence[str], expected: set[JobState], timeout: float = 60
) -> None:
    """A run is FINISHED in the ledger a moment before its process is gone and SLURM says COMPLETED."""
    deadline = time.time() + timeout
    while set((states := executor.states(job_ids)).values()) != expected:
        assert time.time() < deadline, states
        time.sleep(1)


def history(ctx, run_id: str) -> dict[str, list[tuple[int, float]]]:
    return open_ledger(ctx.tracking_uri).metric_histories([run_id])[run_id]


def assert_complete_history(ctx, run_id: str, steps: int, eval_every: int = 2) -> None:
    """Every step of every metric once: train/* at 1..steps, eval/* at 0, eval_every, ..., steps."""
    hist = history(ctx, run_id)
    train = [k for k in hist if k.startswith("train/")]
    evals = [k for k in hist if k.startswith("eval/")]
    assert "train/reward" in train and {"eval/toy24", "eval/toy25"} <= set(evals), sorted(hist)
    for key in train:
        assert [s for s, _ in hist[key]] == list(range(1, steps + 1)), key
    for key in evals:
        assert [s for s, _ in hist[key]] == sorted({*range(0, steps + 1, eval_every), steps}), key


def step0_artifact_mtime(ctx, run_id: str) -> float:
    """When the step-0 evaluation of a run was written: a run resumed from a checkpoint never redoes it."""
    from mlflow import MlflowClient

    root = Path(urlparse(MlflowClient(ctx.tracking_uri).get_run(run_id).info.artifact_uri).path)
    return (root / "per_problem" / "toy24" / "step_0000000.json").stat().st_mtime


def latest_checkpoint_step(run_dir: str) -> int:
    found = sorted(Path(run_dir, "checkpoints").glob("step_*.pt"))
    assert found, f"no checkpoint in {run_dir}"
    return int(found[-1].stem.split("_")[1])


def slurm(*args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60, check=True).stdout


def sacct(*args: str) -> str:
    """`sacct`, waiting out a moment without accounting (another test run may have switched it off)."""
    deadline = time.time() + 120
    while (proc := subprocess.run(["sacct", *args], capture_output=True, text=True, timeout=60)).returncode:
        assert time.time() < deadline, proc.stderr
        time.sleep(2)
    return proc.stdout


def our_jobs(profile: str) -> str:
    """Our jobs in the queue (others may share the cluster): by the profile's job name."""
    return slurm("squeue", "-h", "-n", yaml.safe_load(Path(profile).read_text())["job_name"], "-o", "%A")


def _job_logs(ctx) -> str:
    logs = sorted(ctx.run_root.glob("*/*/logs/*.log")) + sorted((ctx.run_root / ".slurm").glob("*.out"))
    return "\n".join(f"--- {p}\n{p.read_text()[-1500:]}" for p in logs[-6:])


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_sweep_goes_out_as_one_array_and_finishes(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pdmctl.cli import app

    profile = write_profile(tmp_path, max_concurrent=6)
    ctx, sweep, job_ids = start_sweep(tmp_path, ["mask=grpo_clip_higher,dppo_topk_kl,pdm_agg", "seed=0,1",
                                                 "backend.steps=4"], profile)  # fmt: skip
    assert len(job_ids) == 6 and len({j.split("_")[0] for j in job_ids}) == 1, job_ids  # one array
    assert sorted(int(j.split("_")[1]) for j in job_ids) == list(range(6))
    views = wait_until(ctx, sweep, all_in(RunState.FINISHED), 300, "6 finished runs")
    for v in views:
        assert v.record.status == "FINISHED" and v.record.attempt == 1
        assert_complete_history(ctx, v.record.run_id, steps=4)
    wait_for_job_states(make_executor(ctx.profile), job_ids, {JobState.COMPLETED})
    # `pdmctl logs RUN --follow` reads the job's output off the shared filesystem, and returns once it ended
    result = CliRunner().invoke(app, ["logs", views[0].key, "--follow", "--cluster", profile,
                                      "--tracking-uri", ctx.tracking_uri])  # fmt: skip
    assert result.exit_code == 0 and "pdmctl job: finished" in result.output, result.output
    # `pdmctl status` of the finished sweep: the CPU-hours spent by its 6 jobs, from sacct (each job's Elapsed
    # x its allocated CPUs: the allocation holds each attempt the ledger recorded), beside the prediction
    shown = CliRunner().invoke(app, ["status", sweep, "--cluster", profile, "--tracking-uri", ctx.tracking_uri],
                               env={"COLUMNS": "300"}).stdout  # fmt: skip
    line = next(ln for ln in shown.splitlines() if ln.startswith(f"cost of {sweep}: "))
    assert " CPU-hours spent by the 6 run(s) that started (from sacct: " in line and ", predicted " in line, line
    assert " left" not in line and "CPU-hours expected (" in line, line
    hours = float(line.split(": ")[1].split(" ")[0])
    ledger = sum(spent_seconds(v.record, now=0) or 0 for v in views)
    assert hours * 3600 + 6 >= ledger > 0, (hours, ledger)
    elapsed = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", job_ids[0].split("_")[0], "-o", "Elapsed"],
                             capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    seconds = sum(int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in (e.split(":") for e in elapsed))
    assert len(elapsed) == 6 and hours == pytest.approx(seconds / 3600, rel=0.06), (hours, elapsed)
    assert any(ln.split()[3:5] == ["6", "6"] for ln in shown.splitlines() if ln.startswith("toy: toy-small")), shown


def test_scancel_mid_run_then_resume_finishes_from_the_checkpoint(tmp_path: Path) -> None:
    # SLURM's scancel is SIGTERM (which the job blocks), then SIGKILL after KillWait: a fast machine
    # trains to the end in that window. To make the test independent of this machine's speed, the
    # run is held still before the cancel: once it has a checkpoint, the test takes the SQLite store's
    # write lock, so the job waits at its next metric (a busy store is waited out, not lost) until
    # SLURM kills it. The lock is let go once the job's processes are gone.
    profile = write_profile(tmp_path)
    ctx, sweep, (job_id,) = start_sweep(tmp_path, ["backend.steps=40"], profile)
    (view,) = orchestrate.status(ctx, sweep)
    checkpoints = Path(view.record.run_dir) / "checkpoints"
    deadline = time.time() + 120
    while not any(checkpoints.glob("step_*.pt")):
        assert time.time() < deadline, _job_logs(ctx)
        time.sleep(0.05)
    store = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)
    store.execute("BEGIN IMMEDIATE")
    try:
        slurm("scancel", job_id)
        # sacct says CANCELLED at once; squeue says COMPLETING until KillWait's SIGKILL has taken effect
        deadline = time.time() + 60
        while slurm("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T").strip() != "CANCELLED":
            assert time.time() < deadline, slurm("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T")
            time.sleep(0.5)
    finally:
        store.execute("ROLLBACK")
        store.close()
    (view,) = wait_until(ctx, sweep, all_in(RunState.CANCELLED), 60, "the cancelled state")
    assert view.record.status == "KILLED" and view.record.reason.startswith("cancelled")
    checkpoint = latest_checkpoint_step(view.record.run_dir)
    assert 2 <= checkpoint < 40

    resumed_at = time.time()
    chosen, new_ids = orchestrate.resume(ctx, sweep)
    assert [v.key for v in chosen] == [view.key] and len(new_ids) == 1 and new_ids[0] != job_id
    (view,) = wait_until(ctx, sweep, all_in(RunState.FINISHED), 180, "the resumed run to finish")
    assert view.record.attempt == 2 and view.record.job_id == new_ids[0]
    assert_complete_history(ctx, view.record.run_id, steps=40)  # complete, every step once
    assert step0_artifact_mtime(ctx, view.record.run_id) < resumed_at  # attempt 2 started at its checkpoint


def test_an_interrupt_between_sbatch_and_the_ledger_never_submits_twice(tmp_path: Path, monkeypatch) -> None:
    profile = write_profile(tmp_path)
    name = f"t{uuid.uuid4().hex[:8]}"
    specs = grid.expand([*TOY, "backend.steps=2"], None, name)
    ctx = orchestrate.make_context(profile, f"sqlite:///{tmp_path / 'mlflow.db'}")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # the array went out; the ledger never heard of its job id
        m.setattr(SqlLedger, "mark_submitted", interrupted)
        with pytest.raises(KeyboardInterrupt):
            orchestrate.sweep(specs, ctx)
    plan, job_ids = orchestrate.sweep(specs, ctx)
    assert job_ids == [] and set(plan.states.values()) <= orchestrate.ACTIVE, plan.states
    assert orchestrate.resume(ctx, name) == ([], [])
    (view,) = wait_until(ctx, name, all_in(RunState.FINISHED), 300, "the one job to finish")
    job_name = yaml.safe_load(Path(profile).read_text())["job_name"]
    jobs = sacct("-n", "-P", "-X", "--name", job_name, "-o", "JobID").split()
    assert jobs == [view.record.job_id] and view.record.attempt == 1, (jobs, view.record)


def test_scontrol_requeue_resumes_from_the_checkpoint_as_the_next_attempt(tmp_path: Path) -> None:
    # 400 steps: a quiet 2-core machine runs this config at about 20 steps/s, and with 40 the first
    # attempt once ended between the test's look at step 6 and its requeue (in a CI run)
    profile = write_profile(tmp_path)
    ctx, sweep, (job_id,) = start_sweep(tmp_path, ["backend.steps=400"], profile)
    view = wait_for_step(ctx, sweep, 6)
    requeued_at = time.time()
    slurm("scontrol", "requeue", job_id)
    # the job comes back by itself: while SLURM holds it, it is never cancelled or lost (so `resume`
    # leaves it alone), though the SIGTERM of the requeue reached it. On a fast machine the second
    # attempt may run to its end between two looks: finished after a requeue is as good as running.
    seen: list[JobState | None] = []
    while not (seen and seen[-1] == JobState.RUNNING and {JobState.REQUEUED, JobState.PENDING} & set(seen)):
        (view,) = orchestrate.status(ctx, sweep)
        if view.state == RunState.FINISHED and {JobState.REQUEUED, JobState.PENDING} & set(seen):
            break
        assert view.state in orchestrate.ACTIVE, (view, seen)
        seen.append(view.job_state)
        assert time.time() < requeued_at + 120, seen
        time.sleep(0.5)
    attempt_2 = Path(view.record.run_dir) / "logs" / "attempt-2.log"
    wait = time.time() + 60
    while not (attempt_2.exists() and "attempt 2" in attempt_2.read_text()):
        assert time.time() < wait, seen
        time.sleep(0.5)
    (view,) = wait_until(
        ctx, sweep, lambda vs: vs[0].state not in orchestrate.ACTIVE, 240, "the requeued run"
    )
    assert view.state == RunState.FINISHED, view
    assert view.record.attempt == 2 and view.record.job_id == job_id  # same job, second attempt
    assert_complete_history(ctx, view.record.run_id, steps=400)
    assert step0_artifact_mtime(ctx, view.record.run_id) < requeued_at


def test_a_failed_job_that_slurm_requeues_is_queued_and_never_gets_a_second_job(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from pdmctl.cli import app

    # Seen in CI: n2 was lost mid-training, and the trainer on n1 failed at once (its driver had been on n2): the
    # job wrote FAILED into its run, and SLURM then requeued the job for the lost node. `status` said failed for a
    # job SLURM held: `sweep --wait` gave up, and `resume` would have started a second job beside the requeued one.
    # Here the job fails by itself once it has checkpointed step 4 (PDMCTL_TOY_FAIL_AT_STEP: a fresh attempt only),
    # and `scontrol requeue` brings the failed job back, as SLURM does after a node failure.
    monkeypatch.setenv("PDMCTL_TOY_FAIL_AT_STEP", "4")  # sbatch passes the environment to the job
    profile = write_profile(tmp_path)
    ctx, sweep, (job_id,) = start_sweep(tmp_path, ["backend.steps=40"], profile)
    (view,) = wait_until(ctx, sweep, lambda vs: vs[0].state not in orchestrate.ACTIVE, 180, "the job's failure")
    assert view.state == RunState.FAILED and "failed at step 4" in (view.record.reason or ""), view
    assert latest_checkpoint_step(view.record.run_dir) == 4
    executor = make_executor(ctx.profile)
    wait_for_job_states(executor, [job_id], {JobState.FAILED})
    requeued_at = time.time()
    slurm("scontrol", "requeue", job_id)
    # once SLURM holds the job again, the run is queued or running until its next attempt ends, never failed,
    # and neither `resume` nor the same sweep submits anything for it
    wait_for_job_states(executor, [job_id], {JobState.PENDING}, timeout=30)  # sacct's word may lag a moment
    (view,) = orchestrate.status(ctx, sweep)
    assert view.state == RunState.QUEUED and view.record.status == "FAILED", view
    shown = CliRunner().invoke(app, ["status", sweep, "--cluster", profile, "--tracking-uri", ctx.tracking_uri],
                               env={"COLUMNS": "300"}).stdout  # fmt: skip
    assert "queued (its job lives on; attempt 1" in shown and "1 queued" in shown, shown
    assert orchestrate.resume(ctx, sweep) == ([], [])
    plan, again = orchestrate.sweep(grid.expand([*TOY, "backend.steps=40"], None, sweep), ctx)
    assert again == [] and set(plan.states.values()) <= orchestrate.ACTIVE, plan.states
    seen = []
    while (view := orchestrate.status(ctx, sweep)[0]).state != RunState.FINISHED:
        seen.append(view.state)
        assert view.state in orchestrate.ACTIVE, (view, seen, _job_logs(ctx))
        assert time.time() < requeued_at + 180, (seen, _job_logs(ctx))
        time.sleep(0.5)
    assert view.record.attempt == 2 and view.record.job_id == job_id  # the same job, its second attempt
    assert sacct("-n", "-P", "-X", "--name", yaml.safe_load(Path(profile).read_text())["job_name"],
                 "-o", "JobID").split() == [job_id]  # fmt: skip
    assert_complete_history(ctx, view.record.run_id, steps=40)  # every step once
    assert step0_artifact_mtime(ctx, view.record.run_id) < requeued_at  # attempt 2 started at step 4's checkpoint


def test_a_job_that_lost_a_node_requeues_itself_until_max_node_losses(tmp_path: Path, monkeypatch) -> None:
    """A node lost mid-run that SLURM never saw fail (a Ray node's step ended; a node back before SlurmdTimeout):
    the job records its run FAILED ("node lost: ..."), asks SLURM for its own requeue, and the next attempt of
    the same job resumes from the checkpoint to the end, every step once. With the profile's max_node_losses
    spent the run stays failed, and says so."""
    monkeypatch.setenv("PDMCTL_TOY_LOSE_NODE_AT_STEP", "4")  # sbatch passes the environment to the job
    profile = write_profile(tmp_path)
    ctx, sweep, (job_id,) = start_sweep(tmp_path, ["backend.steps=40"], profile)
    seen = []
    while (view := orchestrate.status(ctx, sweep)[0]).state != RunState.FINISHED:
        seen.append((view.state, view.record.status if view.record else None))
        assert view.state in orchestrate.ACTIVE, (view, seen, _job_logs(ctx))  # never failed meanwhile
        assert len(seen) < 400, (seen, _job_logs(ctx))
        time.sleep(0.5)
    assert view.record.attempt == 2 and view.record.job_id == job_id, view.record  # the same job, requeued
    attempt_1 = (Path(view.record.run_dir) / "logs" / "attempt-1.log").read_text()
    assert f"pdmctl job: requeued job {job_id} (node loss 1 of at most 3)" in attempt_1, attempt_1[-2000:]
    assert_complete_history(ctx, view.record.run_id, steps=40)  # every step once
    assert latest_checkpoint_step(view.record.run_dir) == 40

    (tmp_path / "spent").mkdir()
    spent = write_profile(tmp_path / "spent", max_node_losses=0)
    ctx, sweep, (job_id,) = start_sweep(tmp_path / "spent", ["backend.steps=40"], spent)
    (view,) = wait_until(ctx, sweep, lambda vs: vs[0].state not in orchestrate.ACTIVE, 180, "the run's end")
    assert view.state == RunState.FAILED and view.record.reason.startswith("node lost: lost at step 4"), view
    attempt_1 = (Path(view.record.run_dir) / "logs" / "attempt-1.log").read_text()
    assert "not requeued: the run has lost 1 node(s), more than max_node_losses=0" in attempt_1, attempt_1[-2000:]
    wait_for_job_states(make_executor(ctx.profile), [job_id], {JobState.FAILED})


@pytest.mark.timeout(900)
def test_job_reaching_its_time_limit_is_requeued_and_completes(tmp_path: Path, monkeypatch) -> None:
    # slurmctld checks limits every 30 s and this config trains about 20 steps/s on a quiet 2-core machine,
    # so the run is held still once it has checkpointed step 4 (PDMCTL_TOY_HOLD_AT_STEP, pdmctl.testhooks;
    # the requeued attempt, which starts from that checkpoint, never holds): it is mid-training whatever
    # this machine's speed, in 40 steps rather than the 4,000 this test once needed (437 s under load).
    # The running job's limit is then cut to the minute after next, with a 120 s USR2 `signal_delay_s`:
    # the signal is due at once and comes at slurmctld's next check, a minute or more before the limit
    # itself; submitit checkpoints and requeues, and the limit goes back to 10 min for the second attempt.
    monkeypatch.setenv("PDMCTL_TOY_HOLD_AT_STEP", "4")  # sbatch passes the environment to the job
    monkeypatch.setenv("PDMCTL_TOY_HOLD_S", "600")
    profile = write_profile(tmp_path, time=10, signal_delay_s=120, max_timeouts=3)
    ctx, sweep, (job_id,) = start_sweep(tmp_path, ["backend.steps=40"], profile)
    (view,) = wait_until(ctx, sweep, lambda vs: bool(vs[0].record.run_dir), 120, "the run's directory")
    attempt_1 = Path(view.record.run_dir) / "logs" / "attempt-1.log"
    deadline = time.time() + 300
    while not (attempt_1.exists() and "pdmctl: held at step 4" in attempt_1.read_text()):
        assert time.time() < deadline, attempt_1.read_text()[-3000:] if attempt_1.exists() else "no log"
        time.sleep(0.5)
    cut_time_limit_to_the_minute_after_next(job_id)
    deadline = time.time() + 90
    while "Requeued job" not in attempt_1.read_text():
        assert time.time() < deadline, attempt_1.read_text()[-3000:]
        time.sleep(0.5)
    slurm("scontrol", "update", f"jobid={job_id}", "TimeLimit=10")
    log = attempt_1.read_text()
    assert "this job is timed-out" in log and "DUE TO TIME LIMIT" not in log, log[-3000:]  # before the limit
    (view,) = wait_until(
        ctx, sweep, lambda vs: vs[0].state not in orchestrate.ACTIVE, 600, "the timed-out run"
    )
    assert view.state == RunState.FINISHED, view
    assert view.record.attempt == 2 and view.record.job_id == job_id, view.record  # the same job, requeued once
    assert_complete_history(ctx, view.record.run_id, steps=40)
    assert "held at step" not in (Path(view.record.run_dir) / "logs" / "attempt-2.log").read_text()
    wait_for_job_states(make_executor(ctx.profile), [job_id], {JobState.COMPLETED})
    records = sacct("-n", "-P", "-X", "-D", "-o", "JobID,State", "-j", job_id).split()
    assert records == [f"{job_id}|REQUEUED", f"{job_id}|COMPLETED"], records


def test_status_without_accounting_falls_back_to_squeue(tmp_path: Path) -> None:
    switch = REPO / ".ci" / "slurm_up.sh"
    # one accounting switch at a time on this cluster (another test run may share it)
    lock = open("/tmp/pdmctl-slurm-accounting.lock", "a")  # noqa: SIM115 (held until the end)
    fcntl.flock(lock, fcntl.LOCK_EX)
    subprocess.run([str(switch)], env={**os.environ, "ACCOUNTING": "none"}, check=True, timeout=120,
                   capture_output=True)  # fmt: skip
    try:
        assert subprocess.run(["sacct", "-n"], capture_output=True).returncode != 0  # accounting really off
        profile = write_profile(tmp_path)
        ctx, sweep, _ = start_sweep(tmp_path, ["backend.steps=2,400"], profile)
        by_steps = {}
        for v in orchestrate.status(ctx, sweep):
            by_steps[v.record.spec.config["backend"]["steps"]] = v
        short, long = by_steps[2], by_steps[400]
        wait_until(ctx, sweep, lambda vs: all(v.state == RunState.FINISHED for v in vs if v.key == short.key)
                   and any(v.state == RunState.RUNNING for v in vs if v.key == long.key), 180,
                   "the short run finished and the long one running")  # fmt: skip
        executor = make_executor(ctx.profile)
        wait_for_job_states(executor, [short.record.job_id], {JobState.COMPLETED})
        states = executor.states([short.record.job_id, long.record.job_id, "999999_0"])
        assert states == {short.record.job_id: JobState.COMPLETED, long.record.job_id: JobState.RUNNING,
                          "999999_0": JobState.UNKNOWN}, states  # fmt: skip
        slurm("scancel", long.record.job_id)
        views = wait_until(
            ctx, sweep, lambda vs: all(v.state not in orchestrate.ACTIVE for v in vs), 60, "cancel"
        )
        final = {v.key: v.state for v in views}
        assert final == {short.key: RunState.FINISHED, long.key: RunState.CANCELLED}, final
    finally:
        subprocess.run([str(switch)], env={**os.environ, "ACCOUNTING": "dbd"}, check=True, timeout=180,
                       capture_output=True)  # fmt: skip
        lock.close()


def test_scheduler_array_split_at_max_array_size(tmp_path: Path, monkeypatch) -> None:
    # a cluster whose MaxArraySize is 4: 6 requests become arrays of 4 and 2, the %-limit shared 2 + 1
    fake = tmp_path / "bin"
    fake.mkdir()
    real = shutil.which("scontrol")
    (fake / "scontrol").write_text(f'#!/bin/bash\nif [ "$1 $2" = "show config" ]; then {real} "$@" | '
                                   f"sed -E 's/^(MaxArraySize +=).*/\\1 4/'; else exec {real} \"$@\"; fi\n")  # fmt: skip
    (fake / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    ctx = orchestrate.make_context(write_profile(tmp_path, max_concurrent=3, sbatch=["--hold"]),
                                   f"sqlite:///{tmp_path / 'mlflow.db'}")  # fmt: skip
    executor = make_executor(ctx.profile)
    requests = [
        JobRequest(f"run{i}", f"key{i}", tmp_path / f"job{i}.json", tmp_path / f"log{i}", 1) for i in range(6)
    ]
    job_ids = executor.submit(requests)
    try:
        bases = [j.split("_")[0] for j in job_ids]
        assert len(set(bases)) == 2 and bases.count(bases[0]) == 4 and bases.count(bases[-1]) == 2, job_ids
        throttles = [slurm("scontrol", "show", "job", f"{b}_0").split("ArrayTaskThrottle=")[1].split()[0]
                     for b in dict.fromkeys(bases)]  # fmt: skip
        assert throttles == ["2", "1"]
        assert set(executor.states(job_ids).values()) == {JobState.PENDING}
    finally:
        executor.cancel(job_ids)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"partition": "nope"}, "cluster bad: partition 'nope' does not exist (partitions: debug"),
     ({"gpus_per_node": 16}, "cluster bad: partition debug: no node has 16 GPUs (the most is 8"),
     ({"nodes": 3}, "cluster bad: partition debug has 1 node(s); the profile asks for nodes: 3"),
     ({"mem_gb": 100000}, "cluster bad: partition debug: no node has 100000 GB of memory"),
     ({"sbatch": ["--constraint=nosuchfeature"]},
      "cluster bad: sbatch refused the job array: Invalid feature specification"),
     ({"sbatch": ["--exclusive"]}, "cluster bad: partition debug has 1 node(s) and a job takes 1 node(s), each "
      "whole (--exclusive): max_concurrent 6 x nodes 1 cannot run at once; at most 1 can (set max_concurrent: 1)"),
     ({"cpus_per_task": 32}, "cluster bad: partition debug has 1 node(s) and a job takes 1 node(s), 2 job(s) to a "
      "node by its CPUs: max_concurrent 6 x nodes 1 cannot run at once; at most 2 can")],
)  # fmt: skip
def test_bad_profile_values_get_one_clear_line(tmp_path: Path, options, message) -> None:
    from typer.testing import CliRunner

    from pdmctl.cli import app

    profile = write_profile(tmp_path, name="bad", **options)
    result = CliRunner().invoke(app, ["sweep", *TOY, "backend.steps=2", "--cluster", profile,
                                      "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"])  # fmt: skip
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {message}"), result.output
    assert "Traceback" not in result.output and "sbatch: error" not in result.output, result.output
    assert our_jobs(profile) == ""  # nothing reached the queue


def test_dry_run_prints_the_sbatch_script_and_submits_nothing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pdmctl.cli import app

    profile = write_profile(tmp_path, max_concurrent=2, gpus_per_node=2)
    result = CliRunner().invoke(app, ["sweep", *TOY, "seed=0,1,2", "--cluster", profile, "--dry-run",
                                      "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"])  # fmt: skip
    assert result.exit_code == 0, result.output
    for line in ("sbatch --array=0-2%2", "#SBATCH --array=0-2%2", "#SBATCH --gres=gpu:2", "#SBATCH --partition=debug",
                 "#SBATCH --requeue", "-m submitit.core._submit"):  # fmt: skip
        assert line in result.output, line
    assert our_jobs(profile) == ""


# ---------------------------------------------------------------------------
# The PostgreSQL-backed MLflow server
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_server() -> str:
    if shutil.which("pg_ctlcluster") is None:
        pytest.skip("no PostgreSQL here (pg_ctlcluster absent)")
    pytest.importorskip("psycopg2")
    proc = subprocess.run(
        [str(REPO / ".ci" / "mlflow_server_up.sh")], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(f"mlflow_server_up.sh failed: {proc.stderr[-2000:]}")
    return f"http://127.0.0.1:{os.environ.get('MLFLOW_PORT', '5055')}"


@pytest.mark.postgres
def test_eight_concurrent_jobs_log_every_metric_to_the_postgres_backed_server(
    tmp_path: Path, mlflow_server
) -> None:
    profile = write_profile(tmp_path, max_concurrent=8)
    ctx, sweep, job_ids = start_sweep(tmp_path, ["seeds=8", "backend.steps=6"], profile, uri=mlflow_server)
    assert len(job_ids) == 8 and len({j.split("_")[0] for j in job_ids}) == 1
    views = wait_until(
        ctx, sweep, lambda vs: all(v.state not in orchestrate.ACTIVE for v in vs), 420, "8 runs"
    )
    assert {v.state for v in views} == {RunState.FINISHED}, [(v.key, v.state, v.record.reason) for v in views]
    points = set()
    for v in views:
        assert_complete_history(ctx, v.record.run_id, steps=6)
        hist = history(ctx, v.record.run_id)
        points.add(frozenset((k, s) for k, series in hist.items() for s, _ in series))
    assert len(points) == 1  # every run has the same (metric, step) points: none lost anywhere
    # the 8 jobs ran at the same time: their [start, end] intervals all overlap
    # a run is FINISHED in the ledger a moment before its job's end reaches accounting (End=Unknown)
    deadline = time.monotonic() + 120
    while True:
        rows = slurm(
            "sacct", "-n", "-P", "-X", "-o", "JobID,Start,End", "-j", job_ids[0].split("_")[0]
        ).splitlines()
        if not any("Unknown" in row for row in rows if "[" not in row) or time.monotonic() > deadline:
            break
        time.sleep(2)
    spans = [tuple(datetime.fromisoformat(t) for t in row.split("|")[1:]) for row in rows if "[" not in row]
    assert len(spans) == 8 and max(s for s, _ in spans) < min(e for _, e in spans), spans


def test_unreachable_tracking_server_is_refused_before_submission(tmp_path: Path) -> None:
    profile = write_profile(tmp_path)
    specs = grid.expand([*TOY, "backend.steps=2"], None, "unreachable")
    ctx = orchestrate.make_context(profile, "http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(LedgerError, match=r"tracking URI http://127.0.0.1:9: not reachable"):
        orchestrate.sweep(specs, ctx)
