"""A resumed VeRL job logs no step twice: VeRL's own MLflow adapter, a real MLflow store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

SCRIPT = """
import os, sys
import mlflow
from verl.utils import tracking
from pdmctl.backends.verl import resume

resume.install()
mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
mlflow.start_run(run_id=os.environ["MLFLOW_RUN_ID"])
adapter = tracking._MlflowLoggingAdapter()
for step in [int(s) for s in sys.argv[1].split(",")]:
    adapter.log({"actor/loss": float(step) + float(sys.argv[2]), "val-core/aime24/acc/mean@16": 0.5}, step)
if len(sys.argv) > 4:  # the pdmctl job has ended the run (a failure) while this TaskRunner still exits
    mlflow.MlflowClient().set_terminated(os.environ["MLFLOW_RUN_ID"], status=sys.argv[4])
if sys.argv[3] == "finish":
    tracking.Tracking.finish(type("T", (), {"logger": {"mlflow": adapter}})())
# else: the process exits with the run active (MLflow's exit handler would end it FINISHED)
"""


def _job(uri: str, run_id: str, steps: str, offset: float, end: str = "finish", *job_status: str) -> None:
    """One 'job' in its own process, as the TaskRunner is: the guard reads the run afresh."""
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run_id, "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", SCRIPT, steps, str(offset), end, *job_status], env=env, check=True,
                   timeout=300)  # fmt: skip


def test_a_resumed_job_logs_no_step_twice_and_keeps_the_first_value(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    _job(uri, run_id, "0,1,2,3", 0.0, "exit")  # killed after logging step 3; its last checkpoint was step 2
    assert client.get_run(run_id).info.status == "RUNNING"  # MLflow's exit handler did not end it
    _job(uri, run_id, "2,3,4,5", 100.0)  # resumed: validates again at 2, runs 3 again, goes on
    assert client.get_run(run_id).info.status == "RUNNING"  # VeRL's finish left it to the pdmctl job
    for key in ("actor/loss", "val-core/aime24/acc/mean_at_16"):  # VeRL's own sanitised name
        history = client.get_metric_history(run_id, key)
        steps = [m.step for m in history]
        assert sorted(steps) == [0, 1, 2, 3, 4, 5], (key, steps)
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "actor/loss")}
    assert loss == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 104.0, 5: 105.0}


@pytest.mark.parametrize("end", ["finish", "exit"])
def test_a_trainer_that_exits_after_the_job_ended_the_run_leaves_its_status(tmp_path: Path, end: str) -> None:
    """CI, on a busy machine: the job had set FAILED when VeRL's TaskRunner went through its exit, whose
    detach wrote RUNNING over it. Leaving the run (VeRL's finish, or the process's exit) writes no status."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    _job(uri, run_id, "0,1", 0.0, end, "FAILED")
    assert client.get_run(run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run_id, "actor/loss")] == [0, 1]


def test_without_a_ledger_run_nothing_is_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.utils import tracking

    from pdmctl.backends.verl import resume

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setattr(resume, "_INSTALLED", False)
    before = tracking._MlflowLoggingAdapter.log
    resume.install()
    assert tracking._MlflowLoggingAdapter.log is before


def test_the_tests_hold_holds_a_fresh_run_at_its_step_only(monkeypatch, capsys) -> None:
    """`PDMCTL_VERL_HOLD_AT_STEP` (the requeue and node-loss tests' hook): the TaskRunner stays at that
    step of a run that started fresh, printing a line, and lets go after `PDMCTL_VERL_HOLD_S`."""
    import time

    from pdmctl.backends.verl import resume

    monkeypatch.delenv(resume.HOLD_ENV, raising=False)
    resume.hold_if_asked(1, fresh_run=True)  # not asked
    monkeypatch.setenv(resume.HOLD_ENV, "3")
    monkeypatch.setenv(resume.HOLD_S_ENV, "0.2")
    resume.hold_if_asked(2, fresh_run=True)  # another step
    resume.hold_if_asked(3, fresh_run=False)  # a resumed attempt never holds
    assert capsys.readouterr().out == ""
    started = time.monotonic()
    resume.hold_if_asked(3, fresh_run=True)
    assert time.monotonic() - started >= 0.2
    out = capsys.readouterr().out
    assert "pdmctl: held at step 3 for 0 s" in out and "pdmctl: let go at step 3 after 0 s" in out, out
    monkeypatch.setenv(resume.HOLD_ENV, "x")
    resume.hold_if_asked(3, fresh_run=True)  # not a step: ignored
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("given", ["abc", "", "-1", "0", "nan", "inf", "1e9"])
def test_a_bad_hold_limit_is_the_default(monkeypatch, given: str) -> None:
    from pdmctl.backends.verl import resume

    monkeypatch.setenv(resume.HOLD_S_ENV, given)
    assert resume.hold_seconds() == 300.0


# ---------------------------------------------------------------------------
# Live pdmctl names, per-problem records, the spool and no untracked
# training, through VeRL's own Tracking and MLflow adapter in this process
# ---------------------------------------------------------------------------


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`resume.install()` for one test, with VeRL's classes restored after it."""
    import mlflow
    from verl.utils import tracking

    from pdmctl.backends.verl import perproblem, resume

    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)
    monkeypatch.setenv("PDMCTL_SPOOL_DIR", str(tmp_path / "run" / "spool"))
    adapter = tracking._MlflowLoggingAdapter
    saved = [(tracking.Tracking, "__init__", tracking.Tracking.__dict__["__init__"])] + [
        (adapter, name, adapter.__dict__[name]) for name in ("__init__", "log", "finish")]  # fmt: skip
    monkeypatch.setattr(resume, "_INSTALLED", False)
    monkeypatch.setattr(perproblem, "_PENDING", {})
    resume.install()
    yield
    if mlflow.active_run() is not None:
        mlflow.end_run(status="RUNNING")
    for owner, name, value in saved:
        setattr(owner, name, value)


@pytest.fixture
def wrapped(installed, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The wrapped VeRL logging into a run of a SQLite store."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    mlflow.set_tracking_uri(uri)
    return uri, run_id, client


def test_verl_logs_pdmctl_names_live_with_per_problem_records_and_the_job_copy_adds_no_step(wrapped) -> None:
    """`status` reads eval/aime24 and train/reward while VeRL trains (they are logged with VeRL's
    names), and the job's copy at the end adds no step. Each validation's per-problem record goes
    in with its mean, where `load_samples` reads it. All of it goes through the run's spool."""
    import mlflow
    from verl.utils import tracking

    from pdmctl.backends.verl import perproblem
    from pdmctl.backends.verl.metrics import pdmctl_metric_name
    from pdmctl.ledger import RunLogger, load_per_problem, load_samples
    from pdmctl.ledger.spool import Spool

    uri, run_id, client = wrapped
    mlflow.start_run(run_id=run_id)
    adapter = tracking._MlflowLoggingAdapter()
    record = perproblem.records(["aime24"] * 4, ["u1", "u1", "u2", "u2"],
                                {"acc": [True, False, False, False], "pred": ["3", "4", "[INVALID]", "5"]},
                                {"u1": 7, "u2": 2})["aime24"]  # fmt: skip
    perproblem._PENDING["aime24"] = record
    for step in range(4):
        data = {"critic/score/mean": 0.1 * step, "actor/loss": 1.0}
        if step in (0, 3):
            data["val-core/aime24/acc/mean@16"] = 0.25
        adapter.log(data, step)
        live = client.get_run(run_id).data.metrics
        assert live["train/reward"] == pytest.approx(0.1 * step), live  # at once, not at the attempt's end
    steps = {name: sorted(m.step for m in client.get_metric_history(run_id, name))
             for name in ("train/reward", "eval/aime24", "critic/score/mean")}  # fmt: skip
    assert steps == {"train/reward": [0, 1, 2, 3], "eval/aime24": [0, 3], "critic/score/mean": [0, 1, 2, 3]}
    # the problems in the parquet's order (index 2, then 7); answers: an id per distinct answer, -1 for none
    assert record["problems"] == [2, 7] and record["accuracies"] == [0.0, 0.5]
    assert record["correct"] == [[0, 0], [1, 0]] and record["answers"] == [[-1, 0], [0, 1]]
    assert load_samples(uri, run_id, "aime24", 0) == (record["correct"], record["answers"])
    assert load_samples(uri, run_id, "aime24", 3) is None  # no validation record waited for step 3
    assert load_per_problem(uri, run_id, "aime24") == {0: [0.0, 0.5]}
    RunLogger(uri, run_id).copy_metrics(pdmctl_metric_name)  # what the job does after the trainer
    for name in ("train/reward", "eval/aime24"):
        assert sorted(m.step for m in client.get_metric_history(run_id, name)) == steps[name], name
    spool = Spool(adapter._pdmctl_spool.dir, uri, run_id)
    assert spool.pending() == [] and spool.journal.exists()
    adapter.finish()
    assert client.get_run(run_id).info.status == "RUNNING"  # the job sets the final status


def test_verl_does_not_train_without_tracking(installed, monkeypatch: pytest.MonkeyPatch) -> None:
    """VeRL's `Tracking` waits for the server (backoff, PDMCTL_TRACKING_WAIT_S) and then stops the
    trainer with that reason, where VeRL would print "Proceeding without MLflow tracking" and train on."""
    import socket
    import time

    from verl.utils import tracking

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("PDMCTL_TRACKING_WAIT_S", "2")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not answer for \d+ s .*VeRL does not train without tracking"):
        tracking.Tracking("p", "e", ["console", "mlflow"])
    assert time.monotonic() - started < 30


def test_a_resumed_attempt_whose_config_differs_keeps_its_tracking(wrapped, capsys) -> None:
    """VeRL logs its whole config as params at every start, and MLflow refuses a changed value: an attempt
    that resumes with `trainer.val_before_train=false` (pdmctl's, where that validation adds nothing) still
    gets VeRL's MLflow logger; the params stay the first attempt's, a key new to the run is added, and the
    line names what differs."""
    from verl.utils import tracking

    _uri, run_id, client = wrapped
    client.log_batch(run_id, params=[mlflow_param("trainer/val_before_train", "True"), mlflow_param("trainer/a", "1")])
    config = {"trainer": {"val_before_train": False, "a": 1, "b": 2}}
    resumed = tracking.Tracking("p", "e", ["console", "mlflow"], config=config)
    assert "mlflow" in resumed.logger
    assert client.get_run(run_id).data.params == {"trainer/val_before_train": "True", "trainer/a": "1", "trainer/b": "2"}
    assert "pdmctl: this attempt's config differs from the run's params in trainer/val_before_train: the params " \
           "stay the first attempt's" in capsys.readouterr().out  # fmt: skip
    resumed.logger["mlflow"].finish()
    assert client.get_run(run_id).info.status == "RUNNING"  # the job sets the final status


def test_a_trainer_whose_tracking_did_not_start_leaves_the_runs_status_to_the_job(wrapped, monkeypatch) -> None:
    """When VeRL's MLflow logger cannot start after `start_run` succeeded (every `log_params` try fails),
    pdmctl stops the trainer and leaves the run as it was: MLflow's exit handler would otherwise end it
    FINISHED, and a failed attempt would read as a finished run."""
    import mlflow
    from verl.utils import tracking

    _uri, run_id, client = wrapped
    monkeypatch.setattr(tracking, "MLFLOW_SLEEP_SECONDS", 0, raising=False)

    def refused(*args, **kwargs):
        raise mlflow.exceptions.MlflowException("refused")

    monkeypatch.setattr(mlflow, "log_params", refused)
    with pytest.raises(RuntimeError, match="VeRL's MLflow logger did not start"):
        tracking.Tracking("p", "e", ["console", "mlflow"], config={"trainer": {"a": 1}})
    assert mlflow.active_run() is None  # nothing left for MLflow's exit handler to end
    assert client.get_run(run_id).info.status == "RUNNING"


def mlflow_param(key: str, value: str):
    from mlflow.entities import Param

    return Param(key, value)
