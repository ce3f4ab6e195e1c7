"""`pdmctl server`: MLflow's basic-auth app on a PostgreSQL that runs as the user (the pgserver wheel), no root.

PostgreSQL refuses to run as root, so the real test runs pdmctl as the non-root user `pdmsrv` (made with
useradd when the test runs as root, as CI does; run as any other user it runs as that user).
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import pdmctl

REPO = Path(__file__).resolve().parents[1]
USER = "pdmsrv"
LOGIN = {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "pw-7Hq2-never-in-a-file"}
TOY = ["backend.eval_every=2", "backend.checkpoint_every=2", "backend.prompts_per_step=8", "backend.eval_samples=2",
       "backend.group_size=4", "backend.steps=2"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _let_others_through(*paths: Path) -> None:
    """A clone where CI puts it may lie under a directory other users cannot enter (mode 0700): give
    them traversal (o+x, not reading) on each such ancestor for this test run, restored at exit."""
    for path in paths:
        for d in [*reversed(path.resolve().parents), path.resolve()]:
            mode = d.stat().st_mode
            if not mode & stat.S_IXOTH:
                os.chmod(d, mode | stat.S_IXOTH)
                atexit.register(os.chmod, d, stat.S_IMODE(mode))


def _as_user() -> tuple[list[str], dict[str, str], str]:
    """(command prefix, extra environment, home) that run `python -m pdmctl.entry` as a non-root user."""
    if os.geteuid() != 0:
        return [sys.executable], {}, str(Path.home())
    if shutil.which("runuser") is None:
        pytest.skip("root without runuser: cannot run as a non-root user")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", USER], check=True, capture_output=True)
    home = pwd.getpwnam(USER).pw_dir
    run = ["runuser", "-u", USER, "--"]
    if subprocess.run([*run, sys.executable, "-c", "import pdmctl"], capture_output=True).returncode == 0:
        return [*run, sys.executable], {}, home
    # the venv's interpreter lies under a directory the user cannot enter (a pyenv under /root): the system's
    # CPython of the same minor version, with the venv's packages and the checkout on its path (same ABI)
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    path = f"{REPO}:{sysconfig.get_paths()['purelib']}"
    _let_others_through(Path(REPO), Path(sysconfig.get_paths()["purelib"]))
    probe = [*run, "env", f"PYTHONPATH={path}", system, "-c", "import pdmctl, mlflow, pgserver"]
    if not Path(system).exists() or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip(f"user {USER} can run neither {sys.executable} nor {system} with this checkout ({REPO})")
    return [*run, system], {"PYTHONPATH": path}, home


def _api(url: str, path: str, login: dict[str, str] | None = None) -> tuple[int, dict]:
    headers = {}
    if login:
        token = base64.b64encode(
            f"{login['MLFLOW_TRACKING_USERNAME']}:{login['MLFLOW_TRACKING_PASSWORD']}".encode()
        ).decode()
        headers["Authorization"] = f"Basic {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=60) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body.startswith(b"{") else {}
    except urllib.error.HTTPError as exc:
        return exc.code, {}


@pytest.mark.nonroot
@pytest.mark.postgres
@pytest.mark.slow  # MLflow's first start migrates its tables in PostgreSQL: 40-112 s measured here (load 15-18)
def test_server_runs_as_a_user_with_a_login_and_a_job_logs_to_it_and_the_password_is_nowhere() -> None:
    pytest.importorskip("pgserver")
    prefix, extra, home = _as_user()
    base = Path(tempfile.mkdtemp(prefix="pdmsrv-", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(base, USER, USER)
    state = base / "s"  # short: the PostgreSQL socket's path has a limit of 107 bytes
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"HOME": home, "PATH": os.environ["PATH"], "COLUMNS": "200", **extra, **LOGIN}

    def run(*args: str, login: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        cmd = [*prefix, "-m", "pdmctl.entry", *args]
        full = {**env, **(login if login is not None else {})}
        if login == {}:
            full = {k: v for k, v in full.items() if k not in LOGIN}
        return subprocess.run(cmd, cwd=base, env=full, capture_output=True, text=True, timeout=timeout)

    server = ["server", "start", "--dir", str(state), "--port", str(port), "--workers", "1"]
    try:
        t0 = time.monotonic()
        first = run(*server)
        print(f"first start: {time.monotonic() - t0:.1f} s")
        assert first.returncode == 0, first.stderr
        assert "login alice accepted" in first.stdout and "PostgreSQL cluster created" in first.stdout
        again = run(*server)  # idempotent
        assert again.returncode == 0 and "already running" in again.stdout, again.stderr
        wrong = run(*server, login={**LOGIN, "MLFLOW_TRACKING_PASSWORD": "not-the-password"})
        assert wrong.returncode == 2 and "refused the login of alice" in wrong.stderr, wrong.stderr

        # every call but /health needs the login
        assert _api(url, "/health")[0] == 200
        assert _api(url, "/api/2.0/mlflow/experiments/search?max_results=5")[0] == 401

        # a command without the login: one line saying so
        nologin = run("status", "--tracking-uri", url, login={})
        assert nologin.returncode == 2, nologin.stdout + nologin.stderr
        assert "refused the login (none given): set MLFLOW_TRACKING_USERNAME" in nologin.stderr, nologin.stderr
        assert len(nologin.stderr.strip().splitlines()) == 1

        # pdmctl doctor's tracking check: the login accepted; none given where the server asks for one, failing
        doc = run("doctor", "--tracking-uri", url, "--skip=paths", "--skip=disk")
        assert doc.returncode == 0 and "login alice accepted" in doc.stdout, doc.stdout + doc.stderr
        doc = run("doctor", "--tracking-uri", url, login={})
        assert doc.returncode == 2, doc.stdout + doc.stderr
        assert doc.stdout.strip().splitlines()[-1].startswith(f"FAIL  tracking: tracking server {url}: asks for a login")

        # a job logs to it: the login reaches it through the environment, as sbatch passes it to a job
        t0 = time.monotonic()
        done = run("sweep", *TOY, "--name", "srv", "--tracking-uri", url, "--wait", timeout=300)
        print(f"sweep: {time.monotonic() - t0:.1f} s")
        assert done.returncode == 0, done.stdout + done.stderr
        status, found = _api(url, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=srv", LOGIN)
        assert status == 200
        exp = found["experiment"]["experiment_id"]
        req = urllib.request.Request(
            url + "/api/2.0/mlflow/runs/search", data=json.dumps({"experiment_ids": [exp]}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Basic " + base64.b64encode(
                f"{LOGIN['MLFLOW_TRACKING_USERNAME']}:{LOGIN['MLFLOW_TRACKING_PASSWORD']}".encode()).decode()},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as resp:
            runs = json.loads(resp.read())["runs"]
        assert len(runs) == 1 and runs[0]["info"]["status"] == "FINISHED", runs
        assert runs[0]["data"].get("metrics"), "the job logged no metric"

        # what the sbatch script of a SLURM profile would be: printed by the dry run, no login in it
        dry = run("sweep", *TOY, "--name", "srv", "--cluster", str(REPO / "clusters" / "slurm-local.yaml"),
                  "--tracking-uri", url, "--dry-run")  # fmt: skip
        secret = LOGIN["MLFLOW_TRACKING_PASSWORD"]
        assert secret not in dry.stdout + dry.stderr
        assert secret not in json.dumps(runs)  # the ledger: params, tags
        leaks = [str(p) for p in (base.rglob("*")) if p.is_file() and secret.encode() in p.read_bytes()]
        assert not leaks, f"the password is written in {leaks}"  # job.json, logs, server log, ini, the databases
    finally:
        stopped = run("server", "stop", "--dir", str(state), "--port", str(port))
        assert stopped.returncode == 0 and "PostgreSQL stopped" in stopped.stdout, stopped.stderr
        down = run("server", "status", "--dir", str(state), "--port", str(port))
        assert down.returncode == 1 and "not running" in down.stdout
        assert "nothing running" in run("server", "stop", "--dir", str(state), "--port", str(port)).stdout
        shutil.rmtree(base, ignore_errors=True)


def test_server_needs_the_login_in_the_environment(tmp_path: Path) -> None:
    result = pdmctl("server", "start", "--dir", str(tmp_path / "s"),
                    env={"MLFLOW_TRACKING_USERNAME": "", "MLFLOW_TRACKING_PASSWORD": ""})  # fmt: skip
    assert result.returncode == 2
    assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD not set" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "s").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="root only")
def test_server_refuses_root_in_one_line(tmp_path: Path) -> None:
    result = pdmctl("server", "start", "--dir", str(tmp_path / "s"), env=LOGIN)
    assert result.returncode == 2 and "PostgreSQL does not run as root" in result.stderr
    assert not (tmp_path / "s").exists()


def test_dry_run_goes_on_without_a_server_and_says_it_did_not_read_the_ledger(tmp_path: Path) -> None:
    result = pdmctl("sweep", *TOY, "--dry-run", "--tracking-uri", "http://127.0.0.1:9", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "did not read the ledger: tracking URI http://127.0.0.1:9: not reachable" in result.stdout
    assert not list(tmp_path.iterdir())  # wrote nothing
