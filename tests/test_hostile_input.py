"""A hostile user's input, further cases: one line naming the problem, exit 2, nothing written.

Each test names what it refuses. `refused` (from test_bad_input) runs the command in this
process and checks the store and run directories byte for byte.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdmctl.cli import app
from pdmctl.grid import expand, load_sweep_file
from tests.test_bad_input import refused, store  # noqa: F401 (a fixture)

SYN = ["backend=synthetic", "model=synthetic"]
SHIPPED_ANALYSES = Path(__file__).resolve().parents[1] / "docs" / "results" / "analysis"


def shipped_analysis(preset: str) -> dict:
    """A preset's `analyze --json` result as docs/results keeps it (gzipped)."""
    import gzip
    import json

    with gzip.open(SHIPPED_ANALYSES / preset / "analysis.json.gz", "rt", encoding="utf-8") as f:
        return json.load(f)


# -- an empty or falsy grid ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: ablation\ngrid:\n#  k: 10,20,50\n", "grid: is empty"),
        ("name: ablation\ngrid: 0\n", "grid: must be a mapping of key: values, got 0"),
        ("name: ablation\ngrid: false\n", "grid: must be a mapping of key: values, got False"),
        ('name: ablation\ngrid: ""\n', "grid: must be a mapping of key: values, got ''"),
        ("name: ablation\ngrid: {}\n", "grid: is empty"),
        ("name: ablation\nsettings: []\n", "settings: is an empty list"),
        ("name: ablation\n", "no grid: or settings:"),
    ],
)
def test_an_empty_or_falsy_grid_is_refused(store: Path, text: str, needle: str) -> None:  # noqa: F811
    (store / "a.yaml").write_text(text)
    refused(store, ["sweep", "--file", "a.yaml"], needle)


# -- seeds=3 seed=7 -------------------------------------------------------------------------------


def test_seeds_and_seed_together_are_refused(store: Path) -> None:  # noqa: F811
    refused(store, ["sweep", "seeds=3", "seed=7", *SYN], "seed: given twice ('seeds=3' and 'seed=7')")


def test_seed_on_the_command_line_wins_over_seeds_in_the_file(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text("name: s\ngrid:\n  seeds: 3\n  k: 10\n")
    specs = expand(["seed=7", *SYN], load_sweep_file(str(tmp_path / "s.yaml")))
    assert [s.seed for s in specs] == [7]


# -- config-group options are names in their group -------------------------------------------


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        ("mask=/some/dir/evil", "mask: unknown option '/some/dir/evil'; choose from dppo_binary_kl"),
        ("mask=../configs/mask/pdm_agg", "mask: unknown option '../configs/mask/pdm_agg'"),
        ("precision=" + "x" * 300, "precision: unknown option 'xxxx"),
        ("model=" + "y" * 300, "model: unknown option 'yyyy"),
    ],
)
def test_a_config_group_option_is_a_name_not_a_path(store: Path, option: str, needle: str, tmp_path: Path) -> None:  # noqa: F811
    evil = Path("/some/dir")
    assert not (evil / "evil.yaml").exists()
    refused(store, ["sweep", option, "--dry-run"], needle)


def test_an_option_outside_configs_is_never_read(store: Path, tmp_path: Path) -> None:  # noqa: F811
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "evil.yaml").write_text("name: evil\nmethod: pdm\ndivergence: topk_kl\nestimator: agg\n")
    refused(store, ["sweep", f"mask={outside / 'evil'}", *SYN], "mask: unknown option")


# -- files that are not UTF-8 ------------------------------------------------------------------


@pytest.mark.parametrize("command", [["sweep", "--file"], ["sweep", "--cluster"], ["report", "--definition"]])
def test_a_file_that_is_not_utf8_is_one_line(store: Path, command: list[str]) -> None:  # noqa: F811
    (store / "s.yaml").write_bytes(b"\xff\xfegrid:\n")
    refused(store, [*command, "s.yaml"], "s.yaml is not UTF-8 text (byte 0: b'\\xff')")


def test_a_file_name_too_long_is_not_found(store: Path) -> None:  # noqa: F811
    refused(store, ["sweep", "--file", "f" * 300], "sweep file: 'ffff")


# -- interval() and glob() in a sweep ----------------------------------------------------------


def test_interval_in_a_sweep_points_to_tune(store: Path) -> None:  # noqa: F811
    refused(store, ["sweep", "delta=interval(0,1)"], "interval() is a search range for `pdmctl tune`")
    refused(store, ["sweep", "backend.lr=tag(log,interval(1e-4,1e-3))"], "for `pdmctl tune`")


def test_glob_selects_a_groups_options() -> None:
    specs = expand(["mask=glob(pdm_*,exclude=pdm_topk*)", *SYN])
    assert sorted(s.config["mask"]["name"] for s in specs) == ["pdm_agg", "pdm_exact", "pdm_uni"]


@pytest.mark.parametrize(
    ("override", "needle"),
    [("mask=glob(zz*)", "sweeps over no values (no mask option matches"),
     ("k=glob(1*)", "glob() selects options of a config group")],
)
def test_a_glob_that_selects_nothing_is_refused(store: Path, override: str, needle: str) -> None:  # noqa: F811
    refused(store, ["sweep", override], needle)


# -- an empty --tracking-uri -------------------------------------------------------------------


@pytest.mark.parametrize("command", [["sweep", "seed=0", *SYN], ["status"], ["resume"], ["report"]])
def test_an_empty_tracking_uri_is_refused(store: Path, command: list[str]) -> None:  # noqa: F811
    refused(store, [*command, "--tracking-uri", ""], "--tracking-uri: empty (an unset variable?)")


# -- a symlink loop as the run root ------------------------------------------------------------


@pytest.mark.parametrize("command", [["sweep", "seed=0", *SYN], ["resume"], ["sweep", "seed=0", "--dry-run"]])
def test_a_symlink_loop_as_the_run_root(store: Path, command: list[str]) -> None:  # noqa: F811
    (store / "pdmctl-runs").symlink_to("pdmctl-runs")
    refused(store, command, "run directory pdmctl-runs: cannot be resolved (Symlink loop")


# -- output paths checked first ------------------------------------------------------------


def test_report_out_onto_a_file(store: Path) -> None:  # noqa: F811
    (store / "afile").write_text("mine\n")
    refused(store, ["report", "--out", "afile"], "--out afile: a file is there, not a directory")
    (store / "reports").write_text("mine\n")  # the default directory's parent: known once the sweep is
    result = CliRunner().invoke(app, ["report"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: report directory reports/kept: reports is not a directory"
    assert (store / "reports").read_text() == "mine\n"


def test_analyze_checks_its_json_destination_before_the_analysis(workdir: Path) -> None:
    refused(workdir, ["analyze", "--seeds", "1", "--json", "missing/dir/out.json"],
            "--json missing/dir/out.json: directory missing/dir does not exist")  # fmt: skip
    (workdir / "adir").mkdir()
    refused(workdir, ["analyze", "--seeds", "1", "--json", "adir"], "--json adir: is a directory")


# -- status --watch --interval ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "nan", "0", "inf", "-inf"])
def test_watch_interval_must_be_a_pause(store: Path, value: str) -> None:  # noqa: F811
    refused(store, ["status", "--watch", "--interval", value], "--interval: must be a number of seconds >= 0.5")


# -- tune --storage ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("storage", "needle"),
    [("foo://bar", "--storage foo://bar: unsupported database 'foo'"),
     ("not a url", "--storage not a url: not a database URL"),
     ("", "--storage: empty"),
     ("sqlite://", "a SQLite storage is sqlite:///PATH")],
)
def test_tune_refuses_a_storage_it_cannot_open(store: Path, storage: str, needle: str) -> None:  # noqa: F811
    refused(store, ["tune", "delta=interval(0.05,0.3)", *SYN, "--trials", "2", "--storage", storage], needle)
    refused(store, ["tune", "status", "--storage", storage], needle)


# -- the console script: click's usage errors are one line too -------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["sweep", "--max-runs", "abc"], "error: pdmctl sweep: Invalid value for '--max-runs'"),
     (["status", "--nope"], "error: pdmctl status: No such option: --nope"),
     (["logs"], "error: pdmctl logs: Missing argument 'RUN'."),
     (["bogus"], "error: pdmctl: No such command 'bogus'.")],
)
def test_usage_errors_are_one_line(workdir: Path, args: list[str], needle: str) -> None:
    from tests.conftest import pdmctl

    result = pdmctl(*args, cwd=workdir, timeout=120)
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(needle)
    assert not list(workdir.iterdir())


# -- a long config round-trips whole ------------------------------------------------------------


@pytest.mark.parametrize("size", ["one long value", "a thousand overrides"])
def test_a_long_config_runs_reports_and_resumes(workdir: Path, size: str) -> None:
    from pdmctl.ledger import open_ledger
    from tests.conftest import pdmctl, sqlite_uri

    extra = ["+note=" + "x" * 9000] if size == "one long value" else [f"+p{i}=12345" for i in range(1000)]
    res = pdmctl("sweep", *extra, *SYN, "--name", "long", "--wait", cwd=workdir, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (run,) = open_ledger(sqlite_uri(workdir)).runs("long")
    assert run.status == "FINISHED", run
    config = run.spec.config  # type: ignore[union-attr]
    assert config.get("note") == "x" * 9000 or config.get("p999") == 12345
    status = pdmctl("status", "long", cwd=workdir, timeout=120)
    assert status.returncode == 0 and "finished" in status.stdout, status.stdout + status.stderr
    report = pdmctl("report", "long", cwd=workdir, timeout=300)
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stdout + report.stderr
    resumed = pdmctl("resume", "long", cwd=workdir, timeout=120)
    assert resumed.returncode == 0 and "0 run(s) resubmitted" in resumed.stdout, resumed.stdout


# -- a job that dies at start-up says why -------------------------------------------------------


@pytest.mark.parametrize("log", ["a traceback", "nothing"])
def test_a_job_that_died_at_start_up_shows_its_error(workdir: Path, log: str) -> None:
    import json

    from pdmctl import orchestrate
    from pdmctl.ledger import Submission, open_ledger
    from tests.conftest import sqlite_uri

    ctx = orchestrate.make_context("local", sqlite_uri(workdir))
    ledger = open_ledger(ctx.tracking_uri)
    specs = expand(["seed=0", *SYN], sweep="dies")
    ids = ledger.register(specs, {s.key: str(ctx.run_dir_parent(s)) for s in specs})
    run_id, job_id = ids[specs[0].key], "local-abc-0-1"
    ledger.mark_intent({run_id: "abc:0:1"}, ctx.executor_tag())
    ledger.mark_submitted([Submission(run_id, job_id, ctx.executor_tag(), 1, "abc:0:1")])
    done = ctx.run_root / ".local" / "done"  # what the worker records when the job process exits 1
    done.mkdir(parents=True)
    (done / f"{job_id}.json").write_text(json.dumps({"state": "FAILED", "returncode": 1}))
    (record,) = ledger.runs("dies")
    path = orchestrate.log_file(record, ctx)
    path.parent.mkdir(parents=True)
    path.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\njson.decoder.JSONDecodeError: "
                    "Unterminated string starting at: line 1 column 7 (char 6)\n" if log == "a traceback" else "")  # fmt: skip
    result = CliRunner().invoke(app, ["status", "dies", "--tracking-uri", ctx.tracking_uri])
    assert result.exit_code == 0, result.output
    (record,) = ledger.runs("dies")
    if log == "a traceback":
        assert record.reason == ("the job died at start-up: json.decoder.JSONDecodeError: Unterminated string "
                                 "starting at: line 1 column 7 (char 6)")  # fmt: skip
        assert "1 failed" in result.stdout and "JSONDecodeE" in result.stdout
    else:
        assert record.reason == "lost: the job process died"


# -- a non-finite evaluation is a failed run's data ---------------------------------------------


@pytest.mark.parametrize("at", ["final", "last-2"])  # best skips non-finite steps (stats.select_steps)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_evaluation_is_listed_never_averaged(workdir: Path, bad: float, at: str) -> None:
    import math

    from pdmctl.ledger import FINISHED, RunLogger, open_ledger
    from pdmctl.report.collect import collect
    from pdmctl.report.definition import load_definition
    from tests.conftest import sqlite_uri
    from tests.test_report_synthetic import make_sweep

    uri = sqlite_uri(workdir)
    sweep = make_sweep(uri, "inf", [*SYN, "seed=0,1"])
    for run_id, spec in sweep.specs.items():  # through MLflow's own client, as a job logs
        logger = RunLogger(uri, run_id)
        for step in range(5):
            value = bad if (spec.seed == 1 and step == 4) else 0.1 * step
            logger.log_metrics({"eval/toy24": value, "eval/toy25": value}, step)
        logger.finish(FINISHED)
    records = {r.run_id: r for r in open_ledger(uri).runs("inf")}
    sick = sweep.run_id("pdm_agg", 1)
    assert all(not math.isfinite(v) and (math.isnan(v) or v == bad) for _, v in records[sick].latest.values())
    collected = collect(open_ledger(uri), ["inf"], load_definition("default").with_options(at=at))
    ((_row, points),) = collected.by_row.items()
    assert [p.seed for p in points] == [0]  # the healthy seed counts, never pushed out as partial
    (excluded,) = [e for e in collected.excluded if e.run_id == sick]
    assert "not finite" in excluded.reason


# -- the local queue's directory as a file, or read-only ----------------------------------------


def test_the_local_queue_as_a_file_is_refused_before_anything_is_registered(store: Path) -> None:  # noqa: F811
    runs = store / "pdmctl-runs"
    runs.mkdir()
    (runs / ".local").write_text("not a directory\n")
    refused(store, ["sweep", "seed=0", *SYN], f"local executor: {runs / '.local'} is not a directory")
    refused(store, ["resume"], f"local executor: {runs / '.local'} is not a directory")
    result = CliRunner().invoke(app, ["status"])  # reading never writes: it still answers
    assert result.exit_code == 0, result.output
    assert (runs / ".local").read_text() == "not a directory\n"


def test_status_never_makes_the_queue(store: Path) -> None:  # noqa: F811
    from pdmctl.executors import load_profile, make_executor

    executor = make_executor(load_profile("local"))
    assert executor.states(["local-x"]) == {"local-x": "LOST"} and executor.find(["a:0:1"]) == {}
    assert not (store / "pdmctl-runs").exists()


def test_a_read_only_queue_is_refused(tmp_path: Path) -> None:
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.test_bad_input import snapshot

    as_root = os.geteuid() == 0  # as root, run as nobody, for whom 0o555 means read-only
    work = Path(tempfile.mkdtemp(dir="/tmp" if as_root else tmp_path))
    try:
        work.chmod(0o777)
        (work / "pdmctl-runs" / ".local").mkdir(parents=True)
        (work / "pdmctl-runs").chmod(0o777)
        (work / "pdmctl-runs" / ".local").chmod(0o555)
        before = snapshot(work)
        command = [sys.executable, "-m", "pdmctl.cli", "sweep", "seed=0", *SYN]
        if as_root:
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HOME": str(work)}
        env.pop("MLFLOW_TRACKING_URI", None)
        proc = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300, env=env)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert lines == [f"error: local executor: {work / 'pdmctl-runs' / '.local'} is not writable (the job "
                         f"queue goes in {work / 'pdmctl-runs' / '.local'})"], proc.stderr  # fmt: skip
        assert snapshot(work) == before
    finally:
        shutil.rmtree(work)


# -- the worker-lock check cannot be fooled by the heartbeat file ------------------------------


def _hold_worker_lock(root: Path, seconds: int):
    """A process that holds `root`'s worker lock for `seconds` (what a stray `flock worker.lock` does), once
    it holds it; and the pid of a process that has ended, for a heartbeat written by a gone worker."""
    import subprocess
    import sys

    root.mkdir(parents=True)
    (root / "worker.lock").touch()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1]); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(float(sys.argv[2]))",
                               str(root / "worker.lock"), str(seconds)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)  # fmt: skip
    return holder, ended.stdout.strip()


@pytest.mark.parametrize("beat", ["in the future", "just now, by a worker that has ended"])
def test_a_stray_lock_holder_is_named_whatever_the_heartbeat_says(workdir: Path, beat: str) -> None:
    import os
    import time

    from tests.test_bad_input import snapshot

    root = workdir / "pdmctl-runs" / ".local"
    holder, ended = _hold_worker_lock(root, 60)
    try:
        heartbeat = root / "worker.heartbeat"
        if beat == "in the future":
            heartbeat.write_text(str(holder.pid))
            os.utime(heartbeat, (time.time() + 3600, time.time() + 3600))
        else:
            heartbeat.write_text(ended)
        before = snapshot(workdir)
        result = CliRunner().invoke(app, ["sweep", "seed=0", *SYN])
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert f"is held by a process that is not a working pdmctl worker (pid {holder.pid}:" in line
        assert snapshot(workdir) == before
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("kernel", ["names the holder", "says nothing"])
def test_a_worker_that_is_ending_is_not_taken_for_a_stray(workdir: Path, kernel: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A worker that is ending still holds the lock for a moment after its pid has gone from /proc (and a
    new one holds it before it has written its pid): a resume in that moment was refused in CI."""
    from pdmctl.executors import local

    if kernel == "says nothing":  # /proc/locks unreadable, as in some containers: the heartbeat decides
        monkeypatch.setattr(local, "_lock_holders", lambda lock: [])
    root = workdir / "pdmctl-runs" / ".local"
    holder, ended = _hold_worker_lock(root, 2)
    try:
        (root / "worker.heartbeat").write_text(ended)
        result = CliRunner().invoke(app, ["sweep", "seed=0", *SYN])
        assert result.exit_code == 0, result.output
        assert holder.poll() is not None  # the lock was let go within the grace, and only then queued
        assert len(list((root / "queue").glob("*.json")) + list((root / "running").glob("*.json"))
                   + list((root / "done").glob("*.json"))) == 1  # fmt: skip
    finally:
        holder.kill()
        holder.wait()


# -- another writer holds the SQLite lock ------------------------------------------------------


def test_a_busy_store_is_one_line_naming_who_holds_it(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    import subprocess
    import sys
    import time

    from pdmctl.ledger import open_ledger
    from tests.conftest import sqlite_uri

    monkeypatch.setenv("PDMCTL_STORE_BUSY_S", "1")
    db = store / "mlflow.db"
    holder = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], "
                               "isolation_level=None); c.execute('PRAGMA journal_mode=WAL'); c.execute('BEGIN "
                               "IMMEDIATE'); print('held', flush=True); time.sleep(60)", str(db)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        started = time.perf_counter()
        result = CliRunner().invoke(app, ["sweep", "seed=0", *SYN])
        assert time.perf_counter() - started < 30
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"error: tracking store {db}: busy: another process has held its write lock"), line
        assert f"pid {holder.pid}:" in line
    finally:
        holder.kill()
        holder.wait()
    assert [r.sweep for r in open_ledger(sqlite_uri(store)).runs()] == ["kept"]  # nothing registered
    assert not (store / "pdmctl-runs").exists()


# -- committed pages still in the -wal are not a truncated store -------------------------------


def test_pages_in_the_wal_are_not_truncation(store: Path) -> None:  # noqa: F811
    import shutil
    import sqlite3

    db, copy = store / "mlflow.db", store / "copy"
    copy.mkdir()
    live = sqlite3.connect(db, isolation_level=None)  # open while copied: the -wal holds committed pages
    live.execute("PRAGMA journal_mode=WAL")
    live.execute("PRAGMA wal_autocheckpoint=0")
    live.execute("CREATE TABLE filler (x)")
    live.execute("INSERT INTO filler VALUES (zeroblob(200000))")
    for name in ("mlflow.db", "mlflow.db-wal"):
        shutil.copy(store / name, copy / name)
    live.close()
    data = bytearray((copy / "mlflow.db").read_bytes())
    pages = int.from_bytes(data[28:32], "big")  # as a full disk leaves it: the header counts pages that the
    data[28:32] = (pages + 20).to_bytes(4, "big")  # main file lacks; the -wal holds them
    data[92:96] = data[24:28]  # and says the count is valid (version-valid-for = change counter)
    (copy / "mlflow.db").write_bytes(bytes(data))
    result = CliRunner().invoke(app, ["status", "--tracking-uri", f"sqlite:///{copy / 'mlflow.db'}"])
    assert result.exit_code == 0, result.output
    assert "kept" in result.stdout
    check = sqlite3.connect(copy / "mlflow.db")  # after: closing the last connection checkpoints the -wal
    assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    check.close()


def _tables(db: Path) -> set[str]:
    import sqlite3

    conn = sqlite3.connect(db)
    try:
        return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        conn.close()


def test_a_store_whose_creation_a_full_disk_cut_short_is_created_afresh(tmp_path: Path, monkeypatch) -> None:
    """A real full disk (a 128 KiB tmpfs) while MLflow creates the schema (its own creation: no cache for
    pdmctl's copy of an empty store) leaves some of its tables and a migration stamp MLflow itself cannot
    continue from; once space returns, the next command moves that store (no run in it) aside and works
    (a full disk reproduced on a real filesystem)."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    (tmp_path / "no-cache").write_text("")
    monkeypatch.setenv("PDMCTL_CACHE", str(tmp_path / "no-cache" / "cache"))  # a file: no template
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)], check=True)
    try:
        from pdmctl.ledger import LedgerError, SqlLedger

        uri = f"sqlite:///{disk / 'mlflow.db'}"
        with pytest.raises(LedgerError, match="disk is full") as info:  # what `pdmctl sweep` does first
            SqlLedger(uri)
        assert "\n" not in str(info.value)
        left = _tables(disk / "mlflow.db")
        assert "runs" in left and not {"experiment_tags", "latest_metrics"} <= left, left  # cut short
        subprocess.run(["mount", "-o", "remount,size=50m", str(disk)], check=True)
        again = CliRunner().invoke(app, ["status", "--tracking-uri", uri])
        assert again.exit_code == 0, again.output
        assert "created afresh" in again.stderr, again.stderr
        assert {"experiment_tags", "latest_metrics", "runs"} <= _tables(disk / "mlflow.db")
        (aside,) = disk.glob("mlflow.db.incomplete-*[0-9]")
        assert _tables(aside) == left  # moved aside as it was, not deleted
        assert CliRunner().invoke(app, ["status", "--tracking-uri", uri]).exit_code == 0
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_database_of_something_else_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "other.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE runs (id INTEGER)")
    conn.execute("INSERT INTO runs VALUES (1)")
    conn.commit()
    conn.close()
    result = CliRunner().invoke(app, ["status", "--tracking-uri", f"sqlite:///{db}"])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "not a whole MLflow database" in result.output
    assert _tables(db) == {"runs"}  # no MLflow table added, nothing moved aside
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT id FROM runs").fetchall() == [(1,)]
    conn.close()
    assert not list(tmp_path.glob("other.db.incomplete-*"))


# -- a tracking server whose API hangs or fails ------------------------------------------------


class _Server:
    """A tiny tracking server on 127.0.0.1: /health answers OK, the API answers 500 or hangs (bounded)."""

    def __init__(self, api: str) -> None:
        import http.server
        import threading

        stop = self.stop = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                if self.path.rstrip("/").endswith("/health"):
                    body, code = b"OK", 200
                elif api == "500":
                    body, code = b'{"error_code": "INTERNAL_ERROR", "message": "boom"}', 500
                else:
                    stop.wait(30)  # hangs until the test ends (30 s at most)
                    return
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("api", ["500", "hangs"])
@pytest.mark.parametrize("command", [["status"], ["sweep", "seed=0", *SYN]])
def test_a_server_whose_api_fails_is_one_line_within_10_s(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, api: str, command: list[str]
) -> None:
    import time

    import mlflow.tracking  # noqa: F401 (imported before the clock starts: on a loaded machine it takes seconds)

    expand(["seed=0", *SYN])  # so is torch, for the run keys: the clock times the server, not the imports

    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # the ledger sets them; undone after the test
    server = _Server(api)
    try:
        started = time.perf_counter()
        result = CliRunner().invoke(app, [*command, "--tracking-uri", server.uri])
        took = time.perf_counter() - started
    finally:
        server.close()
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: tracking server {server.uri}: "), line
    assert took < 10, (took, line)
    if api == "hangs":
        assert "no answer within 5 s" in line and "MLFLOW_HTTP_REQUEST_TIMEOUT=SECONDS" in line, line
    assert not (workdir / "pdmctl-runs").exists()


# -- a PostgreSQL URI with no server, or no driver --------------------------------------------


@pytest.mark.parametrize("driver", ["installed", "missing"])
@pytest.mark.parametrize("command", [["status"], ["cancel"], ["logs", "abc"], ["report"], ["sweep", "seed=0", *SYN],
                                     ["resume"]])  # fmt: skip
def test_a_bare_postgresql_uri_is_one_line(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, driver: str, command: list[str]
) -> None:
    import sys

    # a bare postgresql:// is SQLAlchemy 2.1's psycopg (3), which [cluster] does not install; psycopg2 it does
    scheme = "postgresql+psycopg2" if driver == "installed" else "postgresql"
    if driver == "missing":
        monkeypatch.setitem(sys.modules, "psycopg", None)  # an import of it fails, as where it is not installed
    uri = f"{scheme}://u:p@127.0.0.1:9/db"
    result = CliRunner().invoke(app, [*command, "--tracking-uri", uri])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: tracking URI {scheme}://u:***@127.0.0.1:9/db: "), line
    assert ("driver is not installed" if driver == "missing" else "cannot connect") in line, line
    assert not list(workdir.iterdir())


# -- VeRL's fields checked at submit ----------------------------------------------------------


VERL = ["backend=verl", "model=qwen3-4b-base"]


@pytest.mark.parametrize(
    ("override", "needle"),
    [("backend.lr=abc", "backend.lr: "), ("backend.temperature=hot", "backend.temperature: "),
     ("backend.val_n=-3", "backend.val_n: must be an integer >= 1"), ("backend.lr=-1e-6", "backend.lr: must be"),
     ("backend.temperature=0", "backend.temperature: must be a number > 0"),
     ("mask.loss_agg_mode=bogus", "mask.loss_agg_mode: unknown 'bogus'; VeRL takes token-mean")],
)
def test_verl_fields_are_checked_at_submit(store: Path, override: str, needle: str) -> None:  # noqa: F811
    refused(store, ["sweep", *VERL, override], needle)


@pytest.mark.verl
@pytest.mark.parametrize(
    ("override", "needle"),
    [("backend.lr=abc", "backend.lr: 'abc' does not fit VeRL's FSDPOptimizerConfig.lr"),
     ("backend.temperature=hot", "backend.temperature: 'hot' does not fit VeRL's RolloutConfig.temperature"),
     ("backend.val_n=2.5", "backend.val_n: 2.5 does not fit VeRL's SamplingConfig.n")],
)
def test_verl_fields_are_checked_against_verls_own_schema(store: Path, override: str, needle: str) -> None:  # noqa: F811
    pytest.importorskip("verl")
    refused(store, ["sweep", *VERL, override], needle)


# == environment, paths and cluster inputs ==========================================================================


# -- a test's hook left in a user's shell ---------------------------------------------------------


@pytest.mark.parametrize("hook", ["PDMCTL_TOY_HOLD_AT_STEP", "PDMCTL_TOY_FAIL_AT_STEP", "PDMCTL_TOY_LOSE_NODE_AT_STEP",
                                  "PDMCTL_VERL_HOLD_AT_STEP", "PDMCTL_VERL_FAIL"])  # fmt: skip
@pytest.mark.parametrize("command", [["sweep", "seed=0", *SYN], ["sweep", "seed=0", *SYN, "--dry-run"], ["resume"],
                                     ["tune", "delta=interval(0.05,0.3)", *SYN, "--trials", "1"],
                                     ["tune", "delta=interval(0.05,0.3)", *SYN, "--trials", "1", "--dry-run"]])  # fmt: skip
def test_a_tests_hook_is_refused_outside_a_test(workdir: Path, monkeypatch: pytest.MonkeyPatch, hook: str,
                                                command: list[str]) -> None:  # fmt: skip
    monkeypatch.setenv(hook, "2")
    monkeypatch.delenv("PYTEST_CURRENT_TEST")  # as in a user's shell: no test is running
    refused(workdir, command, f"{hook}='2' is set: a test's hook, which would hold or break the jobs; unset it")


def test_the_hooks_are_the_holds_and_the_failure_injection(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdmctl import testhooks
    from pdmctl.backends.toy import trainer
    from pdmctl.backends.verl import launch, resume

    names = {trainer.HOLD_ENV, trainer.HOLD_S_ENV, trainer.FAIL_ENV, trainer.LOSE_NODE_ENV, trainer.BREAK_ENV,
             resume.HOLD_ENV, resume.HOLD_S_ENV, launch.HOLD_ENV, launch.HOLD_S_ENV, launch.FAIL_ENV}  # fmt: skip
    assert names == set(testhooks.HOOKS)
    monkeypatch.setenv(trainer.HOLD_ENV, "4")
    testhooks.check_environment()  # a test that sets a hook submits: pytest's PYTEST_CURRENT_TEST is set
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    with pytest.raises(testhooks.TestHookError):
        testhooks.check_environment()
    monkeypatch.setenv(trainer.HOLD_ENV, "")  # set but empty: no hook (the job reads it as none)
    testhooks.check_environment()


# -- a profile's values reach the sbatch script: one line each, numbers finite ------------------


SLURM_LOCAL = (Path(__file__).resolve().parents[1] / "clusters" / "slurm-local.yaml").read_text()


@pytest.mark.parametrize(
    ("line", "needle"),
    [('account: "acct\\ntouch PWNED"', "account: 'acct\\ntouch PWNED' holds a control character ('\\n')"),
     ('qos: "q\\nx"', "qos: 'q\\nx' holds a control character"),
     ('job_name: "j\\n#SBATCH --x"', "job_name: 'j\\n#SBATCH --x' holds a control character"),
     ('partition: "debug\\r"', "partition: 'debug\\r' holds a control character ('\\r')"),
     ('sbatch: ["--constraint=a\\rb"]', "sbatch: '--constraint=a\\rb' holds a control character ('\\r')"),
     ('setup: ["module load x\\nexit 1"]', "setup: 'module load x\\nexit 1' holds a control character"),
     ('env: {NCCL_SOCKET_IFNAME: "eth0\\u0085"}', "env.NCCL_SOCKET_IFNAME: 'eth0\\x85' holds a control character"),
     ('workdir: "/tmp/runs\\nx"', "workdir: '/tmp/runs\\nx' holds a control character"),
     ('workdir: "/tmp/runs-%j"', "workdir: '/tmp/runs-%j' holds '%', which SLURM expands in a job's log path"),
     ("mem_gb: .nan", "mem_gb: must be a positive number, got nan"),
     ("mem_gb: .inf", "mem_gb: must be a positive number, got inf")],
)  # fmt: skip
def test_a_profile_value_that_would_break_the_script_is_refused(workdir: Path, line: str, needle: str) -> None:
    (workdir / "p.yaml").write_text(SLURM_LOCAL + line + "\n")
    for command in (["sweep", "seed=0", *SYN, "--dry-run"], ["sweep", "seed=0", *SYN], ["status"]):
        refused(workdir, [*command, "--cluster", "p.yaml"], f"cluster slurm-local: {needle}")


def test_every_sbatch_line_of_an_odd_but_valid_profile_comes_before_the_first_command(tmp_path: Path) -> None:
    import subprocess

    import yaml

    from pdmctl.executors import load_profile
    from pdmctl.executors.slurm import SlurmExecutor

    fields = {**yaml.safe_load(SLURM_LOCAL), "account": "a b;c", "qos": "q$x", "job_name": "it's \"mine\"",
              "sbatch": ["--constraint=h20&fast", "--exclusive"], "setup": ["module load\tcuda  # a tab: setup only"],
              "env": {"A": "x y'z"}, "workdir": str(tmp_path / "runs with space")}  # fmt: skip
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(fields))
    executor = SlurmExecutor(load_profile(str(tmp_path / "p.yaml")))
    executor.max_array_size = lambda: 1001  # type: ignore[method-assign] (no scheduler asked)
    text = executor.describe([None, None])
    script = "\n".join(line[2:] for line in text.split("sbatch script of the first array:\n", 1)[1].splitlines())
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0, script
    lines = [ln for ln in script.splitlines()[1:] if ln.strip()]  # after the #! line
    first_command = next(i for i, ln in enumerate(lines) if not ln.startswith("#"))
    sbatch = [i for i, ln in enumerate(lines) if ln.startswith("#SBATCH")]
    assert len(sbatch) >= 12 and max(sbatch) < first_command, script
    for option in ("--account='a b;c'", "--array=0-1%", "--partition=debug", "--requeue", "--signal=B:USR2@30",
                   "--time=30", "--constraint='h20&fast'"):  # fmt: skip
        assert any(option in lines[i] for i in sbatch), (option, script)


# -- analyze over a grid; 6, 12: --seeds and --first-seed bounded ----------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--json", "g.json", "delta=0.05,0.3"], "analyze: one config at a time; the overrides make 2 (delta vary)"),
     (["k=10,20", "delta=0.1,0.2"], "the overrides make 4 (delta, k vary)"),
     (["--seeds", "100000000"], "--seeds: must be in [1, 100,000], got 100000000"),
     (["--first-seed", "99999999999999999999"], "--first-seed: must be in [0, 9223372036854775788] for 20 seed(s)"),
     (["--first-seed", "-1"], "--first-seed: must be in [0, "),
     (["--seeds", "2", "--first-seed", str(2**63 - 1)], "for 2 seed(s), got 9223372036854775807")],
)  # fmt: skip
def test_analyze_refuses_a_grid_and_unbounded_seeds(workdir: Path, args: list[str], needle: str) -> None:
    refused(workdir, ["analyze", *args], needle)


# -- PDMCTL_CACHE: the warm-up's cache, the tracking server's lock --------------------------------


@pytest.mark.parametrize("cache", ["a file", "relative"])
@pytest.mark.parametrize("command", [["sweep", "seed=0"], ["sweep", "seed=0", "--dry-run"], ["analyze", "--seeds", "1"]])
def test_an_unusable_warm_up_cache_is_refused_before_any_job(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                                             cache: str, command: list[str]) -> None:  # fmt: skip
    (workdir / "afile").write_text("mine\n")
    monkeypatch.setenv("PDMCTL_TOY_BASE", "warmup")
    monkeypatch.setenv("PDMCTL_CACHE", str(workdir / "afile") if cache == "a file" else "cache")
    needle = (f"the warm-up's cache {workdir / 'afile'}: {workdir / 'afile'} is a file, not a directory"
              if cache == "a file" else "PDMCTL_CACHE='cache': must be an absolute path")  # fmt: skip
    refused(workdir, command, needle)


def test_the_lock_of_a_tracking_server_is_in_one_cache_whatever_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdmctl import ledger

    uri = "http://127.0.0.1:9/"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PDMCTL_CACHE", "")  # an unset variable in a script: the default, not ./locks
    for cwd in (tmp_path, tmp_path / "home"):
        cwd.mkdir(exist_ok=True)
        monkeypatch.chdir(cwd)
        assert ledger._lock_path(uri).parent == tmp_path / "home" / ".cache" / "pdmctl" / "locks"
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("PDMCTL_CACHE", str(tmp_path / "afile"))
    with pytest.raises(ledger.LedgerError, match=r"afile/locks/\w+\.lock: Not a directory") as info, \
            ledger._file_lock(ledger._lock_path(uri)):
        pass
    assert "\n" not in str(info.value)
    monkeypatch.setenv("PDMCTL_CACHE", "rel")
    with pytest.raises(ledger.LedgerError, match="PDMCTL_CACHE='rel': must be an absolute path"):
        ledger._lock_path(uri)


# -- a killed analyze leaves no worker behind ------------------------------------------------------


def test_a_worker_ends_with_its_killed_parent(tmp_path: Path) -> None:
    """What `pdmctl analyze`'s pool workers run first (`run_analysis`'s initializer): kill -9 of the parent
    ends the worker at once, mid-task (SIGINT already ended them cleanly)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    worker = ("import os, sys, time; from pdmctl.lifetime import end_with_parent; end_with_parent(int(sys.argv[1])); "
              "print('ready', flush=True); time.sleep(60)")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys; child = subprocess.Popen("
                               "[sys.executable, '-c', sys.argv[1], str(os.getpid())]); print(child.pid, flush=True); "
                               "child.wait()", worker], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline() == "ready\n"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/status").read_text().find("State:\tZ") < 0:
            assert time.monotonic() < deadline, "the worker outlived its parent"
            time.sleep(0.05)
    finally:
        if Path(f"/proc/{child}").exists():
            os.kill(child, signal.SIGKILL)


# -- logs: a removed log ends --follow; a big log streams ------------------------------------


def test_logs_streams_a_log_and_follow_ends_when_the_log_is_removed(tmp_path: Path, capsys) -> None:
    from pdmctl import terminal

    log = tmp_path / "attempt-1.log"
    text = "é" * (terminal.TAIL_BLOCK // 2 + 3) + "end\n"  # a two-byte character across the blocks' boundary
    log.write_text(text)
    assert terminal.tail(log, follow=False, still_running=lambda: True) is None
    assert capsys.readouterr().out == text
    polls = []

    def still_running() -> bool:  # the run goes on; its directory is removed after the first poll
        polls.append(1)
        if len(polls) == 1:
            log.unlink()
        return len(polls) < 50

    why = terminal.tail(log, follow=True, still_running=still_running, poll=0.01)
    assert why == f"its log {log} was removed while following" and len(polls) == 1
    assert capsys.readouterr().out == text


# -- Ctrl-C while pdmctl starts ------------------------------------------------------------------


INTERRUPT_AT_IMPORT = """
import importlib.abc, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job ignores it)
MODULE = sys.argv[1]
class Interrupt(importlib.abc.MetaPathFinder):  # Ctrl-C the moment MODULE starts importing
    def find_spec(self, name, path, target=None):
        if name == MODULE:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["pdmctl", *sys.argv[2:]]
from pdmctl.entry import main
main()
"""


@pytest.mark.parametrize(("module", "command"), [("typer", ["status"]), ("pdmctl.grid", ["sweep", "seed=0", *SYN])])
def test_ctrl_c_while_pdmctl_starts_is_one_line(workdir: Path, module: str, command: list[str]) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", INTERRUPT_AT_IMPORT, module, *command], cwd=workdir,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 130 and lines == ["pdmctl: interrupted"], proc.stderr[-3000:]
    assert not list(workdir.iterdir())


# -- a study storage Optuna cannot use, refused before anything is written -----------------------------


TUNE = ["tune", "delta=interval(0.05,0.3)", *SYN, "--trials", "1"]


@pytest.mark.parametrize(
    ("storage", "needle"),
    [("not a database", "mlflow.optuna.db is not a SQLite database (move it away, or name another file)"),
     ("a directory", "mlflow.optuna.db is not a file"),
     ("missing directory", "directory /nonexistent/dir does not exist"),
     ("the ledger", "is the ledger itself; Optuna's tables need a database of their own"),
     ("another schema", "other.db holds other tables than Optuna's (runs, ...)")],
)  # fmt: skip
def test_a_study_storage_optuna_cannot_use_is_refused_first(workdir: Path, storage: str, needle: str) -> None:
    import sqlite3

    args = list(TUNE)
    if storage == "not a database":
        (workdir / "mlflow.optuna.db").write_text("not a database\n")
    elif storage == "a directory":
        (workdir / "mlflow.optuna.db").mkdir()
    elif storage == "missing directory":
        args += ["--storage", "sqlite:////nonexistent/dir/o.db"]
    elif storage == "the ledger":
        args += ["--storage", f"sqlite:///{workdir / 'mlflow.db'}"]
    else:
        conn = sqlite3.connect(workdir / "other.db")
        conn.execute("CREATE TABLE runs (id INTEGER)")
        conn.close()
        args += ["--storage", f"sqlite:///{workdir / 'other.db'}"]
    refused(workdir, args, needle)
    refused(workdir, [*args, "--dry-run"], needle)
    assert not (workdir / "mlflow.db").exists()  # no ledger created


# -- a tune file's fields typed; glob() in a space (half-fixed) ------------------------------------


@pytest.mark.parametrize(
    ("tune", "needle"),
    [("grid: [1, 2]\ntune: {space: {delta: 'interval(0.05,0.3)'}, trials: 2}", "grid: must be a mapping"),
     ("tune: {space: [delta], trials: 2}", "tune: space: must be a mapping of key: value, got ['delta']"),
     ("tune: {space: 5, trials: 2}", "tune: space: must be a mapping of key: value, got 5"),
     ("tune: {space: {delta: 'interval(0.05,0.3)'}, trials: many}", "tune: trials: must be an integer, got 'many'"),
     ("tune: {space: {delta: 'interval(0.05,0.3)'}, trials: 2.5}", "tune: trials: must be an integer, got 2.5"),
     ("tune: {space: {delta: 'interval(0.05,0.3)'}, trials: 2, sampler: 5}", "tune: sampler: must be a string")],
)  # fmt: skip
def test_a_tune_files_fields_are_typed(workdir: Path, tune: str, needle: str) -> None:
    (workdir / "t.yaml").write_text(f"name: t\n{tune}\n")
    refused(workdir, ["tune", "--file", "t.yaml", *SYN, "--dry-run"], needle)


def test_glob_in_a_tune_space_is_a_choice_of_the_options_it_matches(workdir: Path) -> None:
    from pdmctl.tune.space import parse_space

    (mask,) = [p for p in parse_space(["mask=glob(pdm_*,exclude=pdm_topk*)", *SYN]).params]
    assert mask.name == "mask" and mask.distribution.choices == ("pdm_agg", "pdm_exact", "pdm_uni")
    refused(workdir, ["tune", "delta=glob(*)", *SYN, "--trials", "2", "--dry-run"],
            "glob() selects options of a config group")  # fmt: skip
    refused(workdir, ["tune", "mask=glob(zz*)", *SYN, "--trials", "2", "--dry-run"], "sweeps over no values")


# -- two drivers on a new study at once ---------------------------------------------------------------


def _open_study_together(plan, options, barrier) -> None:
    from pdmctl.tune.study import open_study

    barrier.wait()
    open_study(plan, options)


def test_two_drivers_creating_a_study_at_once_both_open_it(tmp_path: Path) -> None:
    import multiprocessing

    import optuna

    from pdmctl import orchestrate
    from pdmctl.tune import study as tune_study
    from tests.conftest import sqlite_uri

    ctx = orchestrate.make_context("local", sqlite_uri(tmp_path))
    options = tune_study.Options(trials=1)
    plan = tune_study.check("st", tune_study.Request(overrides=("delta=interval(0.05,0.3)", *SYN)), options, ctx,
                            None)  # fmt: skip
    fork = multiprocessing.get_context("fork")  # this process's imports, so both start at once
    barrier = fork.Barrier(2)
    drivers = [fork.Process(target=_open_study_together, args=(plan, options, barrier)) for _ in range(2)]
    for d in drivers:
        d.start()
    for d in drivers:
        d.join(120)
    assert [d.exitcode for d in drivers] == [0, 0]
    assert [s.study_name for s in optuna.get_all_study_summaries(plan.storage)] == ["st"]


# -- report --analysis whole; an output directory that cannot be created ------------------------


@pytest.mark.parametrize(
    ("analysis", "needle"),
    [({"comparisons": []}, "is not a whole direction analysis (TypeError: AnalysisResult.__init__() missing 7"),
     ("without seeds", "is not a whole direction analysis (TypeError: AnalysisResult.__init__() missing 1 "
                       "required positional argument: 'seeds')"),
     ({"comparisons": [{"x": 1}]}, "is not a whole direction analysis (KeyError: 'ratio')")],
)  # fmt: skip
def test_report_refuses_an_analysis_that_is_not_whole(workdir: Path, analysis, needle: str) -> None:
    import json

    if analysis == "without seeds":
        analysis = {k: v for k, v in shipped_analysis("toy-small").items() if k != "seeds"}
    (workdir / "a.json").write_text(json.dumps(analysis))
    refused(workdir, ["report", "--analysis", "a.json"], f"--analysis: a.json {needle}")


@pytest.mark.parametrize("command", [["report", "--out", "/proc/pdmctl"], ["analyze", "--json", "/proc/x.json"]])
def test_an_output_the_file_system_will_not_take_is_refused_first(workdir: Path, command: list[str]) -> None:
    refused(workdir, command, f"{command[2]}: cannot be created in /proc")


# -- half-fixed: every VeRL field checked at submit; a data_dir too long ---------------------------------


def test_every_verl_backend_field_has_a_check() -> None:
    from pdmctl.backends.registry import VERL_FIELD_CHECKS, _verl_defaults

    assert set(VERL_FIELD_CHECKS) == set(_verl_defaults())


@pytest.mark.parametrize(
    ("override", "needle"),
    [("backend.test_freq=soon", "backend.test_freq: must be an integer >= 1 (steps between evaluations"),
     ("backend.save_freq=0", "backend.save_freq: must be an integer >= 1 (steps between checkpoints"),
     ("backend.total_epochs=-2", "backend.total_epochs: must be an integer >= 1 or null: the model's, got -2"),
     ("backend.data_manifest=abc", "backend.data_manifest: must be the 64-hex digest of a data manifest"),
     ("backend.max_prompt_length=1.5", "backend.max_prompt_length: must be an integer >= 1 (tokens), got 1.5"),
     ("backend.max_ckpt_to_keep=0", "backend.max_ckpt_to_keep: must be an integer >= 1 or null"),
     ("backend.strategy=ddp", "backend.strategy: must be fsdp2, megatron or null"),
     ("backend.data_dir=data", "backend.data_dir: must be an absolute path or null")],
)  # fmt: skip
def test_each_verl_field_is_checked_at_submit(workdir: Path, override: str, needle: str) -> None:
    refused(workdir, ["sweep", *VERL, "backend.nnodes=1", override, "--dry-run"], needle)


@pytest.mark.parametrize("field", ["data_dir", "model_path"])
def test_a_path_too_long_for_the_file_system_is_one_line(workdir: Path, field: str) -> None:
    import yaml

    from tests.test_verl_cluster import _staged

    models, _ = _staged(workdir / "shared", "Qwen3-4B-Base")
    profile = {**yaml.safe_load(SLURM_LOCAL), "models_dir": str(models)}  # offline: the files are checked
    (workdir / "p.yaml").write_text(yaml.safe_dump(profile))
    refused(workdir, ["sweep", *VERL, "backend.nnodes=1", f"backend.{field}=/" + "d" * 300, "--dry-run",
                      "--cluster", "p.yaml"], "/" + "d" * 59 + "...: File name too long")  # fmt: skip


# -- a checkpoint planted in a shared run directory ------------------------------------------


class _Plant:
    """A pickle that, when unpickled, creates a file (what a planted checkpoint would do with its payload)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_a_planted_pickle_checkpoint_never_runs_and_the_run_resumes_from_its_own(tmp_path: Path) -> None:
    import pickle

    from pdmctl.backends.base import InMemoryTracker
    from pdmctl.backends.toy.config import ToyConfig
    from pdmctl.backends.toy.trainer import Learner, load_latest_checkpoint, save_checkpoint

    cfg = ToyConfig(steps=2, prompts_per_step=4, group_size=2, minibatches=1, checkpoint_every=1)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    save_checkpoint(checkpoints, Learner.from_base(cfg).state_dict(1, cfg), 1)  # what pdmctl writes
    ran = tmp_path / "payload-ran"
    (checkpoints / "step_99999999.pt").write_bytes(pickle.dumps({"policy": _Plant(str(ran))}))
    tracker = InMemoryTracker()
    path, state = load_latest_checkpoint(checkpoints, tracker)
    assert not ran.exists()
    assert path.name == "step_00000001.pt" and state["step"] == 1
    (notice,) = tracker.notices
    assert notice.startswith("resumed from step_00000001.pt: step_99999999.pt does not load")


# -- verl.* sizes, counts and fractions bounded before anything is written --------------------


@pytest.mark.parametrize(
    ("override", "needle"),
    [("verl.actor_rollout_ref.rollout.n=-3", "verl.actor_rollout_ref.rollout.n: must be a whole number from 1 to "
                                              "1,000,000,000, got -3"),
     ("verl.data.train_batch_size=0", "verl.data.train_batch_size: must be a whole number from 1"),
     ("verl.data.train_batch_size=" + "1" * 23, "verl.data.train_batch_size: must be a whole number from 1"),
     ("verl.actor_rollout_ref.actor.ppo_mini_batch_size=2.5", "ppo_mini_batch_size: must be a whole number"),
     ("verl.actor_rollout_ref.rollout.gpu_memory_utilization=-5", "gpu_memory_utilization: must be a fraction in "
                                                                  "(0, 1], got -5"),
     ("verl.actor_rollout_ref.rollout.gpu_memory_utilization=1.5", "must be a fraction in (0, 1], got 1.5"),
     ("verl.actor_rollout_ref.rollout.gpu_memory_utilization=0", "must be a fraction in (0, 1], got 0"),
     ("verl.actor_rollout_ref.rollout.top_p=nan", "verl.actor_rollout_ref.rollout.top_p: must be a fraction"),
     ("backend.total_training_steps=" + "1" * 23, "backend.total_training_steps: must be at most 1,000,000,000"),
     ("backend.total_training_steps=1e21", "backend.total_training_steps: must be an integer >= 1"),
     ("verl.critic={ppo_micro_batch_size_per_gpu:-1}", "verl.critic.ppo_micro_batch_size_per_gpu: must be a whole "
                                                        "number from 1"),
     ("verl.critic={optim:{min_lr_ratio:0.1},ppo_epochs:0}", "verl.critic.ppo_epochs: must be a whole number from 1")],
)  # fmt: skip
@pytest.mark.parametrize("dry_run", [True, False])
def test_verl_sizes_counts_and_fractions_are_bounded(workdir: Path, override: str, needle: str, dry_run: bool) -> None:
    refused(workdir, ["sweep", *VERL, "backend.nnodes=1", override, *(["--dry-run"] if dry_run else [])], needle)


@pytest.mark.parametrize("override", ["verl.actor_rollout_ref.rollout.n=8", "verl.actor_rollout_ref.rollout.nnodes=0",
                                      "verl.actor_rollout_ref.rollout.gpu_memory_utilization=1",
                                      "verl.data.train_batch_size=1000000000",
                                      "verl.critic={ppo_micro_batch_size_per_gpu:4,optim:{total_training_steps:-1}}"])  # fmt: skip
def test_verl_values_within_their_bounds_pass(override: str) -> None:
    (spec,) = expand([*VERL, "backend.nnodes=1", override])
    assert spec.key


# -- tune --storage that cannot hold a study, refused before any run is registered -------------


@pytest.mark.parametrize(
    ("storage", "needle"),
    [("postgresql+psycopg2://u:secret@127.0.0.1:9/db", "study storage postgresql+psycopg2://u:***@127.0.0.1:9/db: "
                                                       "cannot connect ("),
     ("mysql://u@127.0.0.1/x", "--storage mysql://u@127.0.0.1/x: its database driver MySQLdb is not installed"),
     ("sqlite:///:memory:", "--storage sqlite:///:memory:: a SQLite storage is sqlite:///PATH (a file, not memory"),
     ("sqlite:///{work}/o.db?mode=ro", "a SQLite storage is sqlite:///PATH, without ?options")],
)  # fmt: skip
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_study_storage_that_cannot_hold_the_study_is_one_line(workdir: Path, storage: str, needle: str,
                                                                 dry_run: bool) -> None:  # fmt: skip
    if storage.startswith("postgresql"):
        pytest.importorskip("psycopg2")
    if storage.startswith("mysql"):
        try:
            import MySQLdb  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.skip("the MySQL driver is installed here")
    args = [*TUNE, "--storage", storage.format(work=workdir), *(["--dry-run"] if dry_run else [])]
    line = refused(workdir, args, needle)
    assert "secret" not in line
    assert not list(workdir.iterdir())  # no ledger, no lock file, no run directory


# -- analyze's outputs checked first; a failed final write keeps the result ---------------------


@pytest.mark.parametrize(("where", "needle"), [("/proc/x", "--figures /proc/x: cannot be created in /proc"),
                                               ("a file", "a file is there, not a directory")])  # fmt: skip
def test_analyze_checks_its_figures_directory_before_the_analysis(workdir: Path, where: str, needle: str) -> None:
    if where == "a file":
        (workdir / "figs").write_text("")
        where = str(workdir / "figs")
    refused(workdir, ["analyze", "--seeds", "1", "--figures", where], needle)


def test_a_failed_final_write_of_analyze_is_one_line_and_keeps_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import json
    import tempfile

    import typer

    from pdmctl.analysis.cli import _kept_on_failure
    from pdmctl.analysis.results import AnalysisResult

    result = AnalysisResult.from_dict(shipped_analysis("toy-llm"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(typer.Exit) as ended, _kept_on_failure(result) as writing:
        writing[0] = "--json /dev/full"
        Path("/dev/full").write_text(result.to_json())  # a full disk
    (kept,) = tmp_path.glob("pdmctl-analysis-*.json")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert ended.value.exit_code == 2
    assert lines == [f"error: --json /dev/full: cannot be written (No space left on device); the result is kept in "
                     f"{kept} (report --analysis reads it)"]  # fmt: skip
    assert AnalysisResult.from_dict(json.loads(kept.read_text())).to_json() == result.to_json()


@pytest.mark.parametrize(("family", "needle"),
                         [("/dev/zero", "--family: /dev/zero: not an analyze --json result (not a regular file)"),
                          ("a fifo", "(not a regular file)"),
                          ("too big", "(larger than 64 MiB)"),
                          ("nested", "not an analyze --json result (maximum recursion depth"),
                          ("not utf-8", "not an analyze --json result ('utf-8' codec can't decode")])  # fmt: skip
def test_analyze_family_reads_only_a_bounded_regular_file(workdir: Path, family: str, needle: str,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:  # fmt: skip
    import os

    path = workdir / "f.json"
    if family == "a fifo":
        path = tmp_path_factory.mktemp("fifo") / "f.json"  # not in workdir: its snapshot would read it
        os.mkfifo(path)  # a reader would block for ever
    elif family == "too big":
        with open(path, "wb") as fh:
            fh.truncate(65 * 2**20)  # sparse: nothing on disk
    elif family == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif family == "not utf-8":
        path.write_bytes(b'{"k": "\xff"}')
    else:
        path = Path(family)
    refused(workdir, ["analyze", "--seeds", "1", "--family", str(path)], needle)


# -- data prepare on damaged local files; a manifest nested or naming a file elsewhere ---------


@pytest.mark.parametrize(
    ("which", "content", "needle"),
    [("train", b"PAR1 not really parquet PAR1", "dapo.parquet: not a readable parquet file ("),
     ("aime24", b'{"problem": "a", "answer": 1}\n{"problem": "b", answer: 2}\n', "aime24.jsonl, line 2: not JSON "
                                                                              "(Expecting property name"),
     ("aime24", b'{"problem": "a", "answer": 1}\n{"problem": "\xff", "answer": 2}\n', "aime24.jsonl, line 2: not "
                                                                                    "UTF-8 (byte 0xff at column 14)"),
     ("aime24", b"[" * 100_000 + b"]" * 100_000 + b"\n", "aime24.jsonl, line 1: nested too deeply"),
     ("aime24", b"7\n", "aime24.jsonl, line 1: a record must be a JSON object, got int '7'"),
     ("aime25", b"42", "aime25.json: must be a list of records or {\"data\": [...]}, got int '42'"),
     ("aime25", b"[1, 2]", "aime25.json, record 0: a record must be a JSON object, got int '1'"),
     ("aime25", b'{"data": 5}', "aime25.json: must be a list of records"),
     ("aime25", b"[\n" + b"{" * 3 + b"\n", "aime25.json, line 2: not JSON (Expecting property name"),
     ("aime25", b'[{"question": "\xc3\x28"}]', "aime25.json, line 1: not UTF-8 (byte 0xc3)"),
     ("aime25", b"[" * 100_000 + b"]" * 100_000, "aime25.json: nested too deeply"),
     ("aime25", b'[{"prompt": [], "reward_model": {}}]', "record 0: needs a problem")],
)  # fmt: skip
def test_data_prepare_on_a_damaged_file_names_the_file_and_line(workdir: Path, which: str, content: bytes,
                                                                 needle: str) -> None:  # fmt: skip
    from tests.test_verl_data import write_fixtures

    sources = dict(zip(("train", "aime24", "aime25"), write_fixtures(workdir), strict=True))
    sources[which].write_bytes(content)
    out = workdir / "prepared"
    args = ["data", "prepare", str(out), *(a for k, p in sources.items() for a in (f"--{k}", str(p)))]
    line = refused(workdir, args, needle)
    assert str(sources[which]) in line and not out.exists()


def test_data_prepare_takes_a_mistyped_local_path_for_no_hub_id(workdir: Path) -> None:
    (workdir / "data").mkdir()
    refused(workdir, ["data", "prepare", str(workdir / "out"), "--train", "data/train.jsonl"],
            "data/train.jsonl: no such file, and not a datasets-hub id")  # fmt: skip
    refused(workdir, ["data", "prepare", str(workdir / "out"), "--train", "data/train"],
            "data/train: no such file, and not a datasets-hub id")  # fmt: skip


def _prepared(workdir: Path) -> Path:
    from pdmctl.backends.verl.data import prepare_data
    from tests.test_verl_data import write_fixtures

    out = workdir / "prepared"
    prepare_data(out, *map(str, write_fixtures(workdir)))
    return out


@pytest.mark.parametrize("damage", ["nested", "outside"])
def test_a_nested_or_escaping_manifest_is_one_line(workdir: Path, damage: str) -> None:
    import json

    from pdmctl.backends.verl.data import MANIFEST, ManifestError, manifest_digest, read_manifest

    out = _prepared(workdir)
    if damage == "nested":
        (out / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
        needle = "corrupt manifest (nested too deeply)"
    else:
        manifest = json.loads((out / MANIFEST).read_text())
        manifest["files"]["../../../../etc/hostname"] = {**manifest["files"].pop("aime24.parquet"),
                                                         "sha256": _sha256_of(Path("/etc/hostname"))}  # fmt: skip
        manifest["digest"] = manifest_digest(manifest)  # recomputed, as a hand edit would
        (out / MANIFEST).write_text(json.dumps(manifest))
        needle = "names '../../../../etc/hostname', not a file of"
    with pytest.raises(ManifestError, match=re.escape(needle)):
        read_manifest(out)


def _sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- doctor's node check looks for the interface the job body will ------------------------------


@pytest.mark.parametrize(("interface", "needle"), [("nosuch0", "has no network interface 'nosuch0' (the profile's "
                                                               "network_interface; its interfaces: "),
                                                   ("lo", "lo has 127.0.0.1 on this node")])  # fmt: skip
def test_doctor_on_the_node_looks_for_the_profiles_network_interface(tmp_path: Path, interface: str,
                                                                     needle: str) -> None:  # fmt: skip
    from pdmctl import doctor, orchestrate
    from tests.test_doctor import _filled_h20

    ctx = orchestrate.make_context(str(_filled_h20(tmp_path, network_interface=interface)))
    assert "network-interface" in doctor.NODE_CHECKS
    check = dict(doctor.Doctor(ctx.profile, ctx.tracking_uri).checks(on_node=True))["network-interface"]
    if interface == "lo":
        assert needle in check()
    else:
        with pytest.raises(doctor.CheckFailed, match=re.escape(needle)):
            check()


# -- environment variables of the submitting shell ----------------------------------------------


def test_a_submitting_shells_slurm_restart_count_never_numbers_a_local_jobs_attempts(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdmctl import orchestrate
    from tests.conftest import sqlite_uri
    from tests.test_identity import finished, wait_for

    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # a shell inside a requeued allocation
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    ctx = orchestrate.make_context("local", sqlite_uri(workdir))
    orchestrate.sweep(expand(["seed=0", *SYN], sweep="env"), ctx)
    (view,) = wait_for(ctx, "env", finished)
    assert view.record.attempt == 1 and not view.record.job_id.startswith("77")
    assert "attempt 1 in" in (Path(view.record.run_dir) / "logs" / "attempt-1.log").read_text()


@pytest.mark.parametrize(("value", "needle"), [("abc", "error: PDMCTL_CONFIG_DIR='abc': must be an absolute path"),
                                               ("", "error: PDMCTL_CONFIG_DIR is set but empty"),
                                               ("/etc/hostname", "error: PDMCTL_CONFIG_DIR=/etc/hostname: not a "
                                                                 "directory"),
                                               ("/nonexistent/x", "error: PDMCTL_CONFIG_DIR=/nonexistent/x: no such "
                                                                  "directory"),
                                               ("/", "error: PDMCTL_CONFIG_DIR=/: no run.yaml there")])  # fmt: skip
def test_a_config_dir_variable_set_to_garbage_is_one_line(workdir: Path, value: str, needle: str) -> None:
    from tests.conftest import pdmctl

    result = pdmctl("sweep", "seed=0", *SYN, "--dry-run", cwd=workdir, env={"PDMCTL_CONFIG_DIR": value})
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(needle), result.stderr[-2000:]
    assert not list(workdir.iterdir())


CTRL_C_THEN_AN_ERROR = """
import sys
import pdmctl.cli
def run():  # a Ctrl-C that leaves a module half-imported: the next import of it fails while it unwinds
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise ImportError("cannot import name 'x' from partially initialized module 'pdmctl.orchestrate'")
pdmctl.cli.main = run
from pdmctl.entry import main
main()
"""


def test_an_error_raised_while_a_ctrl_c_unwinds_is_still_one_line(workdir: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", CTRL_C_THEN_AN_ERROR], cwd=workdir, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 130 and lines == ["pdmctl: interrupted"], proc.stderr[-3000:]


# -- --at beyond any run's evaluations; a SQLite ledger in memory -------------------


def test_report_at_last_n_is_bounded(store: Path) -> None:  # noqa: F811
    refused(store, ["report", "kept", "--at", "last-99999999999999999999"],
            "--at: 'last-99999999999999999999' is not final, best or last-N (1 <= N <= 1,000,000)")  # fmt: skip


@pytest.mark.parametrize("command", [["status"], ["report"], ["sweep", "seed=0", *SYN, "--dry-run"]])
def test_a_sqlite_ledger_in_memory_is_refused(workdir: Path, command: list[str]) -> None:
    refused(workdir, [*command, "--tracking-uri", "sqlite:///:memory:"],
            "tracking URI sqlite:///:memory:: a SQLite store in memory holds no runs")  # fmt: skip


def test_a_dry_run_says_when_the_verl_probe_would_replace_the_trainer(workdir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("PDMCTL_VERL_PROBE", "1")  # left in a shell
    result = CliRunner().invoke(app, ["sweep", *VERL, "backend.nnodes=1", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "PDMCTL_VERL_PROBE=1 is set: each VeRL job would run the probe, not the trainer" in result.stdout


# -- YAML whose aliases expand without bound ("billion laughs"): refused before anything is built ----------


def _alias_bomb(depth: int = 8, width: int = 10) -> str:
    """A YAML flow list of anchors `depth` deep, each naming the one before `width` times: under 1 KB of text
    whose value, expanded, is width**(depth + 1) leaves (a billion for 8 deep, 10 wide)."""
    levels = [f"&l0 [{', '.join(['lol'] * width)}]"]
    levels += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, depth + 1)]
    return f"[{', '.join(levels)}]"


def _run_bounded(args: list[str], cwd: Path) -> tuple[int, str]:
    """The real CLI in a subprocess held to 2 GiB of address space and 60 s: (exit code, stderr). A command
    that expanded the aliases would run out of memory (a MemoryError traceback) or out of time."""
    import os
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"COLUMNS": "200"}
    try:
        proc = subprocess.run([sys.executable, "-m", "pdmctl.cli", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=60, env=env, preexec_fn=limit)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"pdmctl {' '.join(args)} still ran after 60 s")
    return proc.returncode, proc.stderr


BOMBS = {  # where each file's reader would walk the value: a sweep's grid, a report's text, a profile's values
    "sweep file": ("BOMB.yaml", f"name: bomb\ngrid:\n  k: {_alias_bomb()}\n", ["sweep", "--file", "BOMB.yaml", "--dry-run"]),
    "tune file": ("BOMB.yaml", f"name: bomb\ngrid:\n  k: {_alias_bomb()}\ntune:\n  space: {{}}\n", ["tune", "--file", "BOMB.yaml"]),
    "report definition": ("BOMB.yaml", f"name: bomb\ndescription: {_alias_bomb()}\ncolumns: []\n",
                          ["report", "--definition", "BOMB.yaml"]),
    "cluster profile": ("BOMB.yaml", f"name: bomb\nexecutor: local\nworkdir: {_alias_bomb()}\n",
                        ["sweep", "seed=0", *SYN, "--cluster", "BOMB.yaml", "--dry-run"]),
    "config file": ("configs/mask/bomb.yaml", f"name: bomb\nmethod: {_alias_bomb()}\n",
                    ["sweep", "mask=bomb", *SYN, "--dry-run"]),
}  # fmt: skip


@pytest.mark.parametrize("what", list(BOMBS))
def test_a_yaml_bomb_is_one_line_naming_the_file_before_anything_is_built(workdir: Path, what: str) -> None:
    """A file of under 1 KB whose aliases nest 8 deep and 10 wide is refused in one line naming the file and
    its aliases, exit 2, with nothing written: within 2 GiB of memory and 60 s (expanded, it takes all of
    memory or minutes)."""
    import shutil

    from pdmctl.resources import config_dir
    from tests.test_bad_input import snapshot

    name, text, args = BOMBS[what]
    if what == "config file":  # a config tree of the working directory's own, one of its options a bomb
        shutil.copytree(config_dir(), workdir / "configs")
    (workdir / name).write_text(text)
    assert len(text) < 1024
    before = snapshot(workdir)
    code, stderr = _run_bounded(args, workdir)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(f"error: {what.replace('tune', 'sweep')}: ") and Path(name).name in lines[0], lines
    assert "alias expansion exceeds 100,000 nodes" in lines[0], lines
    assert snapshot(workdir) == before


@pytest.mark.parametrize(
    ("text", "needle"),
    [("grid:\n  k: &k [10, *k]\n", "a.yaml: an alias inside the node it names"),
     ("grid:\n  k: " + "[" * 101 + "]" * 101 + "\n", "a.yaml: nests deeper than 100 levels"),
     ("grid:\n  k: " + "[" * 5000 + "]" * 5000 + "\n", "a.yaml: nests deeper than 100 levels"),
     ("grid:\n  k: [10, 20]\n" + "#" * (1 << 20) + "\n", "a.yaml is larger than 1 MiB")],
    ids=["an alias inside itself", "101 deep", "5000 deep", "over 1 MiB"],
)  # fmt: skip
def test_a_yaml_that_contains_itself_nests_too_deep_or_is_huge_is_one_line(store: Path, text: str, needle: str) -> None:  # noqa: F811
    (store / "a.yaml").write_text(text)
    refused(store, ["sweep", "--file", "a.yaml"], needle)


ANCHORED = """\
name: anchored
common: &common {backend: synthetic, model: synthetic}
grid:
  <<: *common
  k: &ks [10, 20]
settings:
  - {<<: *common, delta: 0.1}
  - {delta: 0.2, k: *ks}
"""


def test_yaml_with_ordinary_anchors_and_the_shipped_files_load_as_yaml_safe_load_loads_them(tmp_path: Path) -> None:
    """Anchors, aliases and merge keys of ordinary use load to what `yaml.safe_load` gives, as does every
    shipped sweep file, cluster profile, report definition and config; and a sweep file with them sweeps."""
    import yaml

    from pdmctl.resources import package_dir
    from pdmctl.yamlfiles import safe_load

    shipped = [p for kind in ("sweeps", "clusters", "reports", "configs") for p in package_dir(kind).rglob("*.yaml")]
    assert len(shipped) > 20
    for path in shipped:
        text = path.read_text()
        assert safe_load(text, path) == yaml.safe_load(text), path
    assert safe_load(ANCHORED, "anchored.yaml") == yaml.safe_load(ANCHORED)
    (tmp_path / "anchored.yaml").write_text(ANCHORED.replace("common: &common", "description: &common"))
    sweep = load_sweep_file(str(tmp_path / "anchored.yaml"))
    assert sweep.grid == {"backend": "synthetic", "model": "synthetic", "k": "10,20"}
    assert sweep.settings == [{"backend": "synthetic", "model": "synthetic", "delta": "0.1"},
                              {"delta": "0.2", "k": "10,20"}]  # fmt: skip


# -- a mask plugin that calls exit(): at import, or in its keep decision -------------------------------


def test_a_plugin_that_exits_at_import_is_refused_in_one_line_not_a_silent_success(workdir: Path) -> None:
    """`raise SystemExit(0)` (or `sys.exit()`) in a plugin's module is a plugin that does not import: exit 2,
    one line naming it, nothing written; never a sweep that ends at once with exit 0 and no word."""
    from tests.conftest import pdmctl
    from tests.test_plugins import error_line, install

    env = install(workdir / "site", "exit-masks", {"quits": "raise SystemExit(0)\n"}, "[pdmctl.masks]\nsx = quits:MASK\n")
    res = pdmctl("sweep", "mask=sx", "--dry-run", cwd=workdir, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "mask plugin 'sx' (quits:MASK in exit-masks 0.1): does not import: SystemExit: 0" in error_line(res)
    assert sorted(p.name for p in workdir.iterdir()) == ["site"]


def test_a_keep_decision_that_exits_is_the_plugins_error() -> None:
    """A keep decision that calls exit() raises PluginError naming the plugin (the run's one-line reason)."""
    from pdmctl import plugins

    def keep(t):
        raise SystemExit(3)

    masked = plugins._masked(plugins.MaskPlugin("quitter", keep=keep), "mask plugin 'quitter'")
    with pytest.raises(plugins.PluginError, match=r"^mask plugin 'quitter': keep raised SystemExit: 3 \(on 4 tokens\)"):
        masked(plugins._probe())


# -- analyze --engine verl: the testbed's options, a run named twice, --threads 0 ------------------------


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--json", "out.json"], "--json: an option of the testbed's analysis; the snapshot analysis (--engine verl)"),
        (["--seeds", "3"], "--seeds: an option of the testbed's analysis"),
        (["--csv", "rates.csv"], "--csv: an option of the testbed's analysis"),
        (["--figures", "figs"], "--figures: an option of the testbed's analysis"),
        (["--mismatch-only"], "--mismatch-only: an option of the testbed's analysis"),
        (["--protocols", "sgd"], "--protocols: an option of the testbed's analysis"),
        (["run", "--threads", "0"], "--threads: must be >= 1, got 0"),
        (["run"], "run: named twice (as run too); each run directory is one seed, given once"),
        (["./run/"], "run: named twice (as run too)"),
    ],
)
def test_analyze_engine_refuses_what_it_would_ignore_or_count_twice(store: Path, extra: list[str], needle: str) -> None:  # noqa: F811
    """The snapshot analysis never writes --json/--csv/--figures nor reads the testbed's seeds and protocols: each
    is refused in one line, not ignored with exit 0; a run directory named twice would be two seeds of one run."""
    (store / "run" / "snapshots" / "step-1").mkdir(parents=True)
    refused(store, ["analyze", "--engine", "verl", "run", "--step", "1", *extra], needle)
    assert not (store / "out.json").exists() and not (store / "figs").exists()


def test_model_dir_without_engine_is_refused(store: Path) -> None:  # noqa: F811
    refused(store, ["analyze", "--model-dir", "somewhere"], "--model-dir: goes with --engine verl RUN_DIR --step N")


# -- sweep --dry-run --days / --budget: NaN and negatives named as such; a huge limit printed short ----------


@pytest.mark.parametrize(("flag", "value"), [("--days", "nan"), ("--days", "-1"), ("--budget", "nan"), ("--budget", "-5")])
def test_a_design_limit_that_is_nan_or_negative_is_named_as_such(store: Path, flag: str, value: str) -> None:  # noqa: F811
    """NaN is no number below 0: the line says a finite number > 0 is wanted and shows what was given."""
    line = refused(store, ["sweep", "delta=0.05", "seeds=3", "--dry-run", flag, value], "give --dry-run and a finite number > 0")
    assert line.endswith(f"got {float(value)}")


def test_a_huge_figure_prints_in_a_few_characters() -> None:
    """`--days 1e308` is a limit, not a 400-digit number on the design's line."""
    from pdmctl.budget.cost import number

    assert number(1e308) == "1e+308"
    assert number(30_474_921_083_727.4) == "30,474,921,083,727"
    assert number(63_325.2) == "63,325"


# -- a sweep file that is a directory, or a link that leads nowhere ----------------------------------------


def test_a_sweep_file_that_is_a_directory_or_a_link_loop_is_named_as_such(store: Path) -> None:  # noqa: F811
    """Not 'not found' for a path that is there: a directory, or a symlink loop, says what it is."""
    (store / "dir.yaml").mkdir()
    (store / "loop1.yaml").symlink_to("loop2.yaml")
    (store / "loop2.yaml").symlink_to("loop1.yaml")
    refused(store, ["sweep", "--file", "dir.yaml", "--dry-run"], "sweep file: 'dir.yaml' is a directory, not a YAML file")
    refused(store, ["sweep", "--file", "loop1.yaml", "--dry-run"],
            "sweep file: 'loop1.yaml' is a link that leads to no file (broken, or a loop)")
