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
if sys.argv[3] == "finish":
    tracking.Tracking.finish(type("T", (), {"logger": {"mlflow": adapter}})())
# else: the process exits with the run active (MLflow's exit handler would end it FINISHED)
"""


def _job(uri: str, run_id: str, steps: str, offset: float, end: str = "finish") -> None:
    """One 'job' in its own process, as the TaskRunner is: the guard reads the run afresh."""
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run_id, "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", SCRIPT, steps, str(offset), end], env=env, check=True, timeout=300)


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
