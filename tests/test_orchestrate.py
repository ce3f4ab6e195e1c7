"""sweep / status / resume end to end: real processes, real MLflow on SQLite, the CPU testbed."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pdmctl.grid import expand
from pdmctl.ledger import RunLogger, open_ledger
from pdmctl.orchestrate import RunState, make_context, status
from tests.conftest import FAST, pdmctl, sqlite_uri

ROOT = Path(__file__).resolve().parents[1]
TRAIN_METRICS = ("train/reward", "train/response_length", "train/ppo_kl", "train/mask_frac",
                 "train/out_of_region_frac", "train/mean_divergence", "train/disagreement_count")  # fmt: skip


def states(cwd: Path, sweep: str | None = None) -> dict[str, RunState]:
    ctx = make_context("local", sqlite_uri(cwd))
    return {v.key: v.state for v in status(ctx, sweep)}


def wait_until(predicate, timeout: float = 300, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError("timed out waiting")


def histories(cwd: Path, sweep: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    ledger = open_ledger(sqlite_uri(cwd))
    runs = {r.run_id: r.key for r in ledger.runs(sweep)}
    return {runs[rid]: h for rid, h in ledger.metric_histories(list(runs)).items()}


# ---------------------------------------------------------------------------


def test_readme_quickstart_plans_six_runs_and_ci_runs_it_from_the_wheel(workdir: Path):
    """The README's quickstart, as written, is a sweep of six testbed runs then a report: its sweep command
    plans six runs here (a dry run), and scripts/ci-wheel.sh (in .ci/run) runs both commands, parsed from
    the README the same way, from the installed wheel in an empty folder, and checks the six finished runs
    and the report's paired comparison."""
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    command = next(line for line in quickstart.splitlines() if "pdmctl sweep" in line)
    parts = [part.strip() for part in command.split("&&")]
    sweep_cmd = next(part for part in parts if part.startswith("pdmctl sweep"))
    assert parts[-1] == "pdmctl report", parts
    res = pdmctl(*sweep_cmd.split()[1:], "--dry-run", cwd=workdir)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "6 run(s)" in res.stdout, res.stdout
    assert not (workdir / "mlflow.db").exists()
    wheel_check = (ROOT / "scripts" / "ci-wheel.sh").read_text()
    assert "## Quickstart" in wheel_check and '"6 finished"' in wheel_check and "paired" in wheel_check


def test_six_run_sweep_tracks_everything(workdir: Path):
    res = pdmctl("sweep", "--name", "six", "mask=grpo_clip_higher,dppo_topk_kl,pdm_agg", "seed=0,1", *FAST,
                 "--wait", cwd=workdir)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "submitted 6" in res.stdout
    client = MlflowClient(sqlite_uri(workdir))
    exp = client.get_experiment_by_name("six")
    runs = client.search_runs([exp.experiment_id], "tags.`pdmctl.sweep` = 'six'")  # not the sweep's parent run
    assert len(runs) == 6
    for run in runs:
        assert run.info.status == "FINISHED"
        assert run.data.params["mask.method"] in {"grpo", "dppo", "pdm"}
        assert run.data.params["backend.steps"] == "6"
        assert run.data.tags["pdmctl.sweep"] == "six" and run.data.tags["pdmctl.attempt"] == "1"
        assert run.data.tags["pdmctl.job_id"].startswith("local-")
        for name in (*TRAIN_METRICS, "eval/toy24", "eval/toy25"):
            assert name in run.data.metrics, name
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/reward")]
        assert steps == list(range(1, 7))
    # status: every run finished, with step and avg@16 shown
    out = pdmctl("status", "six", cwd=workdir)
    assert out.returncode == 0 and "6 finished" in out.stdout
    # repeating the sweep submits nothing
    again = pdmctl("sweep", "--name", "six", "mask=grpo_clip_higher,dppo_topk_kl,pdm_agg", "seed=0,1", *FAST,
                   cwd=workdir)  # fmt: skip
    assert again.returncode == 0 and "submitted 0" in again.stdout and "6 finished" in again.stdout
    assert len(client.search_runs([exp.experiment_id], "tags.`pdmctl.sweep` = 'six'")) == 6


def test_kill9_then_resume_continues_from_checkpoint(workdir: Path):
    long = ["backend.steps=30", "backend.eval_every=10", "backend.checkpoint_every=3", "backend.prompts_per_step=16"]
    # the reference: the same run uninterrupted, in another sweep
    ref = pdmctl("sweep", "--name", "ref", "seed=5", *long, "--wait", cwd=workdir)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    res = pdmctl("sweep", "--name", "killed", "seed=5", *long, cwd=workdir)
    assert res.returncode == 0, res.stdout + res.stderr
    ledger = open_ledger(sqlite_uri(workdir))

    def progressed() -> bool:
        (run,) = ledger.runs("killed")
        return (run.step or 0) >= 7

    wait_until(progressed, timeout=300, poll=0.2)
    pattern = f"pdmctl.job {workdir}/pdmctl-runs/killed"
    job_pids = [int(p) for p in subprocess.run(["pgrep", "-f", pattern], capture_output=True,
                                               text=True).stdout.split()]  # fmt: skip
    assert job_pids, "the job process should be running"
    for pid in job_pids:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: states(workdir, "killed").values() and
               next(iter(states(workdir, "killed").values())) in (RunState.LOST, RunState.FAILED), timeout=60)  # fmt: skip
    out = pdmctl("status", "killed", cwd=workdir)
    assert "lost" in out.stdout or "failed" in out.stdout
    resumed = pdmctl("resume", "killed", "--wait", cwd=workdir)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "1 run(s) resubmitted" in resumed.stdout
    (run,) = ledger.runs("killed")
    assert run.status == "FINISHED" and run.attempt == 2
    # every step once, and the same values as the uninterrupted run
    got, want = histories(workdir, "killed"), histories(workdir, "ref")
    (got_h,), (want_h,) = got.values(), want.values()
    assert sorted(got_h) == sorted(want_h)
    for name, series in want_h.items():
        assert [s for s, _ in got_h[name]] == [s for s, _ in series], name  # complete, unduplicated
        assert got_h[name] == series, name
    # a second resume straight after starts nothing
    again = pdmctl("resume", "killed", cwd=workdir)
    assert again.returncode == 0 and "0 run(s) resubmitted" in again.stdout


def test_concurrent_sweeps_submit_each_run_once(workdir: Path):
    args = [sys.executable, "-m", "pdmctl.cli", "sweep", "--name", "race", "seed=0,1,2", *FAST]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    procs = [subprocess.Popen(args, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    submitted = [int(re.search(r"submitted (\d+)", out).group(1)) for out, _ in outs]
    assert sorted(submitted) == [0, 3]
    wait_until(lambda: set(states(workdir, "race").values()) == {RunState.FINISHED}, timeout=300)
    runs = open_ledger(sqlite_uri(workdir)).runs("race")
    assert len(runs) == 3 and all(r.attempt == 1 for r in runs)
    done = workdir / "pdmctl-runs" / ".local" / "done"
    wait_until(lambda: len(list(done.glob("*.json"))) >= 3, timeout=30)
    time.sleep(1)
    assert len(list(done.glob("*.json"))) == 3  # three jobs ran, not six


def _hammer(uri: str, run_id: str, steps: int) -> None:
    logger = RunLogger(uri, run_id)
    logger.start(attempt=1, job_id=f"pid-{os.getpid()}", executor="test")
    for step in range(steps):
        logger.log_metrics({f"m{i}": step * 10 + i for i in range(5)}, step)
    logger.finish("FINISHED")


def test_eight_concurrent_writers_lose_no_metric(workdir: Path):
    uri = sqlite_uri(workdir)
    specs = expand(["seed=range(0,8)"], sweep="writers")
    ledger = open_ledger(uri)
    ids = ledger.register(specs, {s.key: str(workdir / s.key) for s in specs})
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(uri, rid, 60)) for rid in ids.values()]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    hist = ledger.metric_histories(list(ids.values()))
    for rid in ids.values():
        assert sorted(hist[rid]) == [f"m{i}" for i in range(5)]
        for i in range(5):
            assert hist[rid][f"m{i}"] == [(s, float(s * 10 + i)) for s in range(60)]
    assert {r.status for r in ledger.runs("writers")} == {"FINISHED"}


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["foo=1"], "foo: unknown key"),
        (["mask=nope"], "mask: unknown option 'nope'"),
        (["delta=0"], "delta: must be a number > 0"),
        (["k=0"], "k: must be an integer >= 1"),
        (["delta=[0.1,"], "malformed"),
        (["--file", "nope"], "sweep file: 'nope' not found"),
        (["--cluster", "nope"], "cluster profile: 'nope' not found"),
        (["--tracking-uri", "sqlite:////nonexistent/dir/mlflow.db"], "does not exist"),
        (["--tracking-uri", "http://127.0.0.1:9"], "not reachable"),
    ],
)
def test_bad_input_exits_2_and_changes_nothing(workdir: Path, args, needle):
    db = workdir / "mlflow.db"
    if not db.exists():  # a store with a run in it, to show nothing recorded is touched
        ledger = open_ledger(sqlite_uri(workdir))
        spec = expand(["seed=9"], sweep="kept")
        ledger.register(spec, {s.key: str(workdir / s.key) for s in spec})
        ledger.engine.dispose()
    before = _digest(db)
    runs_before = sorted(p.name for p in workdir.iterdir())
    res = pdmctl("sweep", *args, cwd=workdir)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert _digest(db) == before
    assert sorted(p.name for p in workdir.iterdir()) == runs_before  # no run directories, no queue


def test_dry_run_writes_nothing(workdir: Path):
    res = pdmctl("sweep", "delta=0.05,0.15", "k=10,20,50", "--dry-run", cwd=workdir)
    assert res.returncode == 0, res.stderr
    assert "6 new" in res.stdout and "would submit 6" in res.stdout
    assert list(workdir.iterdir()) == []


def test_cancel_and_logs(workdir: Path):
    res = pdmctl("sweep", "--name", "stop", "seed=0", "backend.steps=400", "backend.prompts_per_step=16",
                 cwd=workdir)  # fmt: skip
    assert res.returncode == 0, res.stderr
    ledger = open_ledger(sqlite_uri(workdir))
    wait_until(lambda: (ledger.runs("stop")[0].step or 0) >= 2, timeout=300, poll=0.3)
    (run,) = ledger.runs("stop")
    logs = pdmctl("logs", run.key[:6], cwd=workdir)
    assert logs.returncode == 0 and f"run {run.key}" in logs.stdout
    out = pdmctl("cancel", "stop", "--yes", cwd=workdir)
    assert out.returncode == 0 and "1 run(s) cancelled" in out.stdout
    wait_until(lambda: states(workdir, "stop")[run.key] == RunState.CANCELLED, timeout=60)
    assert not subprocess.run(["pgrep", "-f", f"pdmctl.job {workdir}"], capture_output=True).stdout
    assert ledger.runs("stop")[0].status == "KILLED"
    resumed = pdmctl("resume", "stop", "--max-attempts", "1", cwd=workdir)
    assert "0 run(s) resubmitted" in resumed.stdout  # it already had its one attempt
