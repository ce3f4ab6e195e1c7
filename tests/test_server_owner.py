"""A sweep on a shared `pdmctl server` belongs to the login that created it.

Another login can neither read it (the server's default permission is NO_PERMISSIONS) nor sweep, resume,
cancel or add seeds to it under its name: each is refused in one line, exit code 2, before anything is
written, and the owner's runs and metrics stay as they were. The owner shares it with named logins
(`pdmctl server share`); the runs a login other than the owner registered or submitted are named under
`status`.

The server tests run one real server (PostgreSQL and MLflow's basic-auth app, as tests/test_server.py starts
it) for the whole file, with its admin and two logins: ben creates the sweep, anna tries to use it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdmctl.ledger import RunRecord, SqlLedger, check_owner, login_notes
from tests.test_server import USER, _as_user, _free_port

ADMIN = {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": "admin-pw-4Rt9-in-env-only"}
BEN = {"MLFLOW_TRACKING_USERNAME": "ben", "MLFLOW_TRACKING_PASSWORD": "bens-password-8812"}
ANNA = {"MLFLOW_TRACKING_USERNAME": "anna", "MLFLOW_TRACKING_PASSWORD": "annas-password-5530"}
GRID = ["backend=synthetic", "model=synthetic", "backend.steps=2"]  # one run, a few seconds
SWEEP = "owned"



@dataclass(frozen=True)
class Server:
    url: str
    run: Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """One server for the file: its admin, the logins ben and anna, and ben's sweep SWEEP, finished."""
    pytest.importorskip("pgserver")
    prefix, extra, home = _as_user()
    base = Path(tempfile.mkdtemp(prefix="pdmown-", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(base, USER, USER)
    state, port = base / "s", _free_port()  # short: the PostgreSQL socket's path has a limit of 107 bytes
    env = {"HOME": home, "PATH": os.environ["PATH"], "COLUMNS": "250", **extra}

    def run(*args: str, login: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*prefix, "-m", "pdmctl.entry", *args], cwd=base, env={**env, **login},
                              capture_output=True, text=True, timeout=600, input=stdin)  # fmt: skip

    url = f"http://127.0.0.1:{port}"
    try:
        started = run("server", "start", "--dir", str(state), "--port", str(port), "--workers", "1",
                      login=ADMIN)  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        for login in (BEN, ANNA):
            name = login["MLFLOW_TRACKING_USERNAME"]
            added = run("server", "user", "add", name, "--dir", str(state), "--password-stdin", login=ADMIN,
                        stdin=login["MLFLOW_TRACKING_PASSWORD"] + "\n")  # fmt: skip
            assert added.returncode == 0 and f"login {name} added" in added.stdout, added.stderr
        made = run("sweep", *GRID, "--name", SWEEP, "--tracking-uri", url, "--wait", login=BEN)
        assert made.returncode == 0, made.stdout + made.stderr
        yield Server(url, run)
    finally:
        run("server", "stop", "--dir", str(state), "--port", str(port), login=ADMIN)
        shutil.rmtree(base, ignore_errors=True)


def _call(url: str, path: str, login: dict[str, str], body: dict | None = None) -> tuple[int, dict]:
    user, password = login["MLFLOW_TRACKING_USERNAME"], login["MLFLOW_TRACKING_PASSWORD"]
    token = base64.b64encode(f"{user}:{password}".encode())
    request = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Basic {token.decode()}",
                                              "Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def _everything(url: str) -> dict:
    """Every experiment and every run with its status, end time, tags, params and metrics' histories, as the
    admin reads them: what a refused command must leave as it was."""
    _, found = _call(url, "/api/2.0/mlflow/experiments/search", ADMIN, {"max_results": 1000})
    experiments = sorted((e["experiment_id"], e["name"], json.dumps(e.get("tags", []), sort_keys=True))
                         for e in found.get("experiments", []))  # fmt: skip
    _, found = _call(url, "/api/2.0/mlflow/runs/search", ADMIN,
                     {"experiment_ids": [e[0] for e in experiments], "max_results": 1000})  # fmt: skip
    runs = {}
    for r in found.get("runs", []):
        info, data = r["info"], r["data"]
        histories = {}
        for m in data.get("metrics", []):
            _, h = _call(url, f"/api/2.0/mlflow/metrics/get-history?run_id={info['run_id']}&metric_key="
                         f"{urllib.request.quote(m['key'])}", ADMIN)  # fmt: skip
            histories[m["key"]] = sorted((p["step"], p["value"]) for p in h.get("metrics", []))
        tags, params = (json.dumps(data.get(k, []), sort_keys=True) for k in ("tags", "params"))
        runs[info["run_id"]] = (info["status"], info.get("end_time"), tags, params, histories)
    return {"experiments": experiments, "runs": runs}


def _one_line(result: subprocess.CompletedProcess) -> str:
    """The command failed with exit code 2 and said why in one line on stderr."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.nonroot
@pytest.mark.postgres
@pytest.mark.slow  # the file's first starts the server: PostgreSQL's initdb, MLflow's tables, about a minute
def test_a_new_login_cannot_read_a_sweep_another_login_created(server: Server) -> None:
    """NO_PERMISSIONS is the server's default: anna's login neither reads ben's sweep through MLflow's API nor
    sees it in `status`; asked for it by name, `status` says in one line that it belongs to another login."""
    by_name = f"/api/2.0/mlflow/experiments/get-by-name?experiment_name={SWEEP}"
    assert _call(server.url, by_name, ANNA)[0] == 403
    assert _call(server.url, by_name, BEN)[0] == 200
    everything = server.run("status", "--tracking-uri", server.url, login=ANNA)
    assert everything.returncode == 0 and SWEEP not in everything.stdout, everything.stdout
    named = _one_line(server.run("status", SWEEP, "--tracking-uri", server.url, login=ANNA))
    assert f"sweep '{SWEEP}' belongs to another login" in named and "anna has no access" in named, named
    own = server.run("status", SWEEP, "--tracking-uri", server.url, login=BEN)
    assert own.returncode == 0 and "1 finished" in own.stdout, own.stdout + own.stderr


REFUSED = {
    "sweep": ["sweep", *GRID, "--name", SWEEP],
    "resume": ["resume", SWEEP],
    "cancel": ["cancel", SWEEP],
    "seeds --submit": ["seeds", SWEEP, "--submit"],
}


@pytest.mark.nonroot
@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize("command", list(REFUSED))
def test_another_logins_command_on_a_sweep_is_refused_in_one_line_and_changes_nothing(
    server: Server, command: str
) -> None:
    """anna's sweep of ben's grid under ben's sweep name, her resume, cancel and seeds --submit of it: one
    line naming the sweep as another login's, exit code 2; ben's experiment, runs, tags, params and metrics
    are as they were, and no experiment or run is added."""
    before = _everything(server.url)
    said = _one_line(server.run(*REFUSED[command], "--tracking-uri", server.url, login=ANNA))
    assert f"sweep '{SWEEP}' belongs to another login" in said, said
    assert _everything(server.url) == before


@pytest.mark.nonroot
@pytest.mark.postgres
@pytest.mark.slow
def test_the_admin_reads_another_logins_sweep_but_its_sweep_of_that_name_is_refused_naming_the_owner(
    server: Server,
) -> None:
    """The admin reads every sweep (MLflow lets it write too), yet pdmctl refuses its sweep of ben's name in
    one line naming ben, before anything is written."""
    before = _everything(server.url)
    said = _one_line(server.run("sweep", *GRID, "--name", SWEEP, "--tracking-uri", server.url, login=ADMIN))
    assert f"sweep '{SWEEP}' belongs to login ben" in said and "admin may not change it" in said, said
    assert _everything(server.url) == before


@pytest.mark.nonroot
@pytest.mark.postgres
@pytest.mark.slow
def test_a_sweep_shared_read_only_shows_its_owner_and_refuses_the_readers_sweep(server: Server) -> None:
    """Shared with --read, anna's `status` shows ben's sweep with a line saying whose it is; her sweep of it
    is refused in one line naming ben, and changes nothing; she cannot share it on."""
    shared = server.run("server", "share", SWEEP, "anna", "--read", "--tracking-uri", server.url, login=BEN)
    assert shared.returncode == 0 and "shared with anna: reads it" in shared.stdout, shared.stderr
    seen = server.run("status", SWEEP, "--tracking-uri", server.url, login=ANNA)
    assert seen.returncode == 0 and "1 finished" in seen.stdout, seen.stdout + seen.stderr
    assert f"sweep {SWEEP}: belongs to login ben" in seen.stdout, seen.stdout
    before = _everything(server.url)
    said = _one_line(server.run("sweep", *GRID, "--name", SWEEP, "--tracking-uri", server.url, login=ANNA))
    assert f"sweep '{SWEEP}' belongs to login ben" in said, said
    assert f"pdmctl server share {SWEEP} anna" in said, said
    assert _everything(server.url) == before
    others = _one_line(server.run("server", "share", SWEEP, "anna", "--tracking-uri", server.url, login=ANNA))
    assert "anna may not share sweep" in others and "belongs to login ben" in others, others


@pytest.mark.nonroot
@pytest.mark.postgres
@pytest.mark.slow
def test_once_shared_the_other_login_resumes_and_extends_the_sweep_and_its_runs_are_flagged(
    server: Server,
) -> None:
    """Shared with anna (EDIT), her resume and status of ben's sweep work; the run her sweep adds to it is
    named under ben's `status` and `report` as registered and submitted by anna, not by its owner ben."""
    shared = server.run("server", "share", SWEEP, "anna", "--tracking-uri", server.url, login=BEN)
    assert shared.returncode == 0 and "may sweep, resume and cancel it" in shared.stdout, shared.stderr
    resumed = server.run("resume", SWEEP, "--tracking-uri", server.url, login=ANNA)
    assert resumed.returncode == 0 and "0 run(s) resubmitted" in resumed.stdout, resumed.stderr
    clean = server.run("status", SWEEP, "--tracking-uri", server.url, login=BEN)
    assert clean.returncode == 0 and "other than its owner" not in clean.stdout, clean.stdout + clean.stderr
    added = server.run("sweep", *GRID, "seeds=2", "--name", SWEEP, "--tracking-uri", server.url, "--wait",
                       login=ANNA)  # fmt: skip
    assert added.returncode == 0 and "submitted 1" in added.stdout, added.stdout + added.stderr
    seen = server.run("status", SWEEP, "--tracking-uri", server.url, login=BEN)
    assert seen.returncode == 0 and "2 finished" in seen.stdout, seen.stdout + seen.stderr
    flagged = [line for line in seen.stdout.splitlines() if "other than its owner ben" in line]
    assert len(flagged) == 1 and "1 run(s)" in flagged[0] and flagged[0].endswith("by anna"), seen.stdout
    report = server.run("report", SWEEP, "--out", "report", "--tracking-uri", server.url, login=BEN)
    assert report.returncode == 0, report.stdout + report.stderr
    assert flagged[0] in report.stdout.splitlines(), report.stdout
    theirs = server.run("status", SWEEP, "--tracking-uri", server.url, login=ANNA)
    assert theirs.returncode == 0, theirs.stderr
    assert f"sweep {SWEEP}: belongs to login ben, shared with anna" in theirs.stdout, theirs.stdout


def _record(key: str, owner: str | None, logins: tuple[str, ...], shared: tuple[str, ...] = ()) -> RunRecord:
    return RunRecord(run_id=key, sweep="s", key=key, status="FINISHED", attempt=1, job_id=None, executor=None,
                     spec_json=None, summary="", run_dir=None, reason=None, start_time=None, end_time=None,
                     owner=owner, shared_with=shared, logins=logins)  # fmt: skip


def test_login_notes_name_the_owner_to_other_readers_and_the_runs_other_logins_wrote() -> None:
    """Under status and report: whose a sweep is, for a reader who does not own it, and each run registered
    or submitted by a login other than the owner; nothing for a sweep without an owner (a store without
    logins)."""
    records = [_record("k1", "ben", ("ben",)), _record("k2", "ben", ("ben", "anna")),
               _record("k3", "ben", ())]  # fmt: skip
    assert login_notes(records, "ben") == [
        "sweep s: 1 run(s) registered or submitted by a login other than its owner ben: k2 by anna"
    ]
    assert login_notes(records, "anna")[0] == "sweep s: belongs to login ben"
    shared = [_record("k1", "ben", ("ben",), ("anna",))]
    assert login_notes(shared, "anna") == ["sweep s: belongs to login ben, shared with anna"]
    assert login_notes([_record("k1", None, ("anna",))], "anna") == []
    assert _record("k1", "ben", ()).writable_by("anna") is False
    assert _record("k1", "ben", (), ("anna",)).writable_by("anna") is True
    assert _record("k1", None, ()).writable_by("anna") is True


def test_a_database_store_has_no_owner_even_with_a_login_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SQLite store has no logins: the owner check lets every sweep through and records no owner, whatever
    MLFLOW_TRACKING_USERNAME says."""
    from pdmctl import grid

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "anna")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ledger = SqlLedger(uri)
    specs = grid.expand(GRID, sweep=SWEEP)
    ledger.register(specs, {s.key: str(tmp_path / s.key) for s in specs})
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "ben")
    check_owner(uri, SWEEP)
    [record] = ledger.runs(SWEEP)
    assert record.owner is None and record.logins == () and ledger.writable(record, refuse=True)
