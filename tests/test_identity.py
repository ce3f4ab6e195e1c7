"""A run's identity and its one live job (and the local worker's edge cases): real
local jobs, real MLflow on SQLite, the CPU testbed on its smallest settings."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdmctl import orchestrate
from pdmctl.cli import app
from pdmctl.executors import JobState, make_executor
from pdmctl.executors.local import LocalExecutor
from pdmctl.grid import expand
from pdmctl.ledger import SqlLedger, open_ledger
from pdmctl.orchestrate import RunState, make_context
from tests.test_bad_input import snapshot

TINY = ["backend.steps=2", "backend.eval_every=2", "backend.checkpoint_every=2", "backend.prompts_per_step=8",
        "backend.eval_samples=2", "backend.group_size=4"]  # fmt: skip


def wait_for(ctx, sweep: str, done, timeout: float = 300) -> list[orchestrate.RunView]:
    deadline = time.time() + timeout
    while True:
        views = orchestrate.status(ctx, sweep)
        if views and done(views):
            return views
        assert time.time() < deadline, [(v.key, v.state, v.record and v.record.reason) for v in views]
        time.sleep(0.5)


def finished(views) -> bool:
    return all(v.state == RunState.FINISHED for v in views)


def local_jobs(ctx) -> list[str]:
    root = ctx.run_root / ".local"
    return sorted(p.stem for d in ("queue", "running", "done") for p in (root / d).glob("*.json"))


def test_a_second_store_never_resumes_the_first_stores_checkpoints(workdir: Path) -> None:
    specs = expand(TINY, sweep="smoke")
    first = make_context("local", f"sqlite:///{workdir / 'A.db'}")
    orchestrate.sweep(specs, first)
    (a,) = wait_for(first, "smoke", finished)
    a_files = snapshot(Path(a.record.run_dir))
    assert any(name.startswith("checkpoints/step_") for name in a_files)

    second = make_context("local", f"sqlite:///{workdir / 'B.db'}")
    orchestrate.sweep(specs, second)
    (b,) = wait_for(second, "smoke", finished)
    assert b.key == a.key and b.record.run_dir != a.record.run_dir  # same config, its own directory
    assert Path(b.record.run_dir).name == b.record.run_id
    history = open_ledger(second.tracking_uri).metric_histories([b.record.run_id])[b.record.run_id]
    assert [s for s, _ in history["train/reward"]] == [1, 2]  # trained from step 0, every metric logged
    assert [s for s, _ in history["eval/toy24"]] == [0, 2]
    assert snapshot(Path(a.record.run_dir)) == a_files  # A's files untouched


def test_an_interrupt_between_submit_and_record_never_submits_twice(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # local executor
    ctx = make_context("local", f"sqlite:///{workdir / 'mlflow.db'}")
    specs = expand([*TINY, "seed=0,1"], sweep="twice")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # the job of seed 0 never goes out; seed 1's goes out unrecorded
        m.setattr(LocalExecutor, "submit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            orchestrate.sweep(specs[:1], ctx)
    with monkeypatch.context() as m:
        m.setattr(SqlLedger, "mark_submitted", interrupted)
        with pytest.raises(KeyboardInterrupt):
            orchestrate.sweep(specs[1:], ctx)
    assert len(local_jobs(ctx)) == 1

    plan, job_ids = orchestrate.sweep(specs, ctx)  # seed 0 goes out now; seed 1's job is found
    assert len(job_ids) == 1 and plan.states[specs[1].key] in orchestrate.ACTIVE, plan.states
    assert orchestrate.resume(ctx, "twice") == ([], [])
    views = wait_for(ctx, "twice", finished)
    assert len(local_jobs(ctx)) == 2  # one job per run, ever
    for v in views:
        assert v.record.attempt == 1 and v.record.job_id in local_jobs(ctx)
        log = (Path(v.record.run_dir) / "logs" / "attempt-1.log").read_text()
        assert log.count("pdmctl job: run") == 1, log


def test_a_held_worker_lock_is_said_before_anything_is_queued(workdir: Path) -> None:
    root = workdir / "pdmctl-runs" / ".local"
    root.mkdir(parents=True)
    with open(root / "worker.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # what a stray `flock worker.lock ...` does
        before = snapshot(workdir)
        result = CliRunner().invoke(app, ["sweep", *TINY])
    assert result.exit_code == 2, result.output
    assert "is held by a process that is not a working pdmctl worker" in result.stderr
    assert snapshot(workdir) == before


def test_a_job_that_ends_while_its_worker_is_dead_is_not_lost(workdir: Path) -> None:
    ctx = make_context("local", f"sqlite:///{workdir / 'mlflow.db'}")
    _, (job_id,) = orchestrate.sweep(expand(TINY, sweep="orphan"), ctx)
    root = ctx.run_root / ".local"
    deadline = time.time() + 120
    while not (root / "running" / f"{job_id}.json").exists():
        assert time.time() < deadline
        time.sleep(0.1)
    os.kill(int((root / "worker.heartbeat").read_text()), signal.SIGKILL)  # the job lives on
    executor = make_executor(ctx.profile)
    deadline = time.time() + 300
    while (state := executor.states([job_id])[job_id]) == JobState.RUNNING:
        assert time.time() < deadline
        time.sleep(0.5)
    assert state == JobState.COMPLETED
    (view,) = orchestrate.status(ctx, "orphan")
    assert view.state == RunState.FINISHED


def test_a_job_runs_in_its_submitters_environment_whoever_starts_the_worker(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status` starts a worker for a queue no worker serves, from its own environment; the jobs still run in
    their submitter's (as sbatch's --export=ALL). Found in CI: the engine test's `status` poller won the race
    to start the worker, and the sweep's jobs ran without the variables the sweep was given."""
    from pdmctl.executors import local

    ctx = make_context("local", f"sqlite:///{workdir / 'mlflow.db'}")
    with monkeypatch.context() as m:  # the submitter: a hold at step 2 in its environment, its worker not started
        m.setenv("PDMCTL_TOY_HOLD_AT_STEP", "2")
        m.setenv("PDMCTL_TOY_HOLD_S", "1")
        m.setattr(local, "ensure_worker", lambda root, cap: None)
        orchestrate.sweep(expand(TINY, sweep="submitter"), ctx)
    assert not (ctx.run_root / ".local" / "worker.heartbeat").exists()
    assert "PDMCTL_TOY_HOLD_AT_STEP" not in os.environ
    queued = next((ctx.run_root / ".local" / "queue").glob("*.json"))
    assert queued.stat().st_mode & 0o077 == 0, "the submitter's environment is its owner's to read only"
    (view,) = wait_for(ctx, "submitter", finished)  # this process's `status` starts the worker
    log = orchestrate.log_file(view.record, ctx).read_text()
    assert "pdmctl: held at step 2" in log, log[-2000:]
    assert not any("env" in json.loads(p.read_text()) for p in (ctx.run_root / ".local").rglob("*.json"))


def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(workdir: Path) -> None:
    ctx = make_context("local", f"sqlite:///{workdir / 'mlflow.db'}")
    orchestrate.sweep(expand([*TINY[1:], "backend.steps=4"], sweep="damaged"), ctx)
    (view,) = wait_for(ctx, "damaged", finished)
    checkpoints = Path(view.record.run_dir) / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*.pt")) == ["step_00000002.pt", "step_00000004.pt"]
    newest = checkpoints / "step_00000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # cut short, as a full disk leaves it
    # the run is lost, as a lost run is: its job gone (one that is still exiting keeps a second job off its run)
    executor, job_id, deadline = make_executor(ctx.profile), view.record.job_id, time.time() + 60
    while executor.states([job_id])[job_id].alive:
        assert time.time() < deadline, executor.states([job_id])
        time.sleep(0.2)
    ledger = open_ledger(ctx.tracking_uri)
    ledger.set_status([view.record.run_id], "FAILED", reason="lost: the test says so")
    chosen, _ = orchestrate.resume(ctx, "damaged")
    assert [v.key for v in chosen] == [view.key]
    (view,) = wait_for(ctx, "damaged", finished)
    assert view.record.attempt == 2
    assert view.record.notice.startswith("resumed from step_00000002.pt: step_00000004.pt does not load ("), view
    log = (Path(view.record.run_dir) / "logs" / "attempt-2.log").read_text()
    assert "pdmctl job: resumed from step_00000002.pt: step_00000004.pt does not load" in log, log
    result = CliRunner().invoke(app, ["status", "damaged"])
    assert "finished (resumed from" in result.stdout and "does not load" in result.stdout, result.stdout
    history = ledger.metric_histories([view.record.run_id])[view.record.run_id]
    assert [s for s, _ in history["train/reward"]] == [1, 2, 3, 4]  # steps 3 and 4 again, each logged once
