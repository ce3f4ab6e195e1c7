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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import pdmctl
from tests.test_bad_input import snapshot
from tests.test_cli_contract import _main

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
def test_server_runs_as_a_user_with_a_login_per_user_and_a_job_logs_to_it_and_no_password_is_anywhere() -> None:
    pytest.importorskip("pgserver")
    prefix, extra, home = _as_user()
    base = Path(tempfile.mkdtemp(prefix="pdmsrv-", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(base, USER, USER)
    state = base / "s"  # short: the PostgreSQL socket's path has a limit of 107 bytes
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"HOME": home, "PATH": os.environ["PATH"], "COLUMNS": "200", **extra, **LOGIN}

    def run(*args: str, login: dict[str, str] | None = None, timeout: float = 600,
            stdin: str | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        cmd = [*prefix, "-m", "pdmctl.entry", *args]
        full = {**env, **(login if login is not None else {})}
        if login == {}:
            full = {k: v for k, v in full.items() if k not in LOGIN}
        return subprocess.run(cmd, cwd=base, env=full, capture_output=True, text=True, timeout=timeout, input=stdin)

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
            url + "/api/2.0/mlflow/runs/search",  # the sweep's runs, not its parent run (no pdmctl.sweep tag)
            data=json.dumps({"experiment_ids": [exp], "filter": "tags.`pdmctl.sweep` = 'srv'"}).encode(),
            headers={"Content-Type": "application/json", "Authorization": "Basic " + base64.b64encode(
                f"{LOGIN['MLFLOW_TRACKING_USERNAME']}:{LOGIN['MLFLOW_TRACKING_PASSWORD']}".encode()).decode()},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as resp:
            runs = json.loads(resp.read())["runs"]
        assert len(runs) == 1 and runs[0]["info"]["status"] == "FINISHED", runs
        assert runs[0]["data"].get("metrics"), "the job logged no metric"

        # a login per user: the admin adds bob (his password on standard input, never an argument); bob's login
        # reads the ledger, but not alice's sweep (tests/test_server_owner.py); a wrong password of his is
        # refused; added twice it is unchanged; removed, refused
        bob = {"MLFLOW_TRACKING_USERNAME": "bob", "MLFLOW_TRACKING_PASSWORD": "bobs-own-password-17"}
        added = run("server", "user", "add", "bob", "--dir", str(state), "--password-stdin",
                    stdin=bob["MLFLOW_TRACKING_PASSWORD"] + "\n")  # fmt: skip
        assert added.returncode == 0 and "login bob added" in added.stdout, added.stdout + added.stderr
        again = run("server", "user", "add", "bob", "--dir", str(state), "--password-stdin", stdin="another-one-123\n")
        assert again.returncode == 0 and "already exists" in again.stdout, again.stdout + again.stderr
        as_bob = run("status", "--tracking-uri", url, login=bob)
        assert as_bob.returncode == 0 and "srv" not in as_bob.stdout, as_bob.stdout + as_bob.stderr
        not_his = run("status", "srv", "--tracking-uri", url, login=bob)
        assert not_his.returncode == 2 and "belongs to another login" in not_his.stderr, not_his.stderr
        wrong_bob = run("status", "--tracking-uri", url, login={**bob, "MLFLOW_TRACKING_PASSWORD": "not-bobs-password"})
        assert wrong_bob.returncode == 2 and len(wrong_bob.stderr.strip().splitlines()) == 1, wrong_bob.stderr
        short = run("server", "user", "add", "carol", "--dir", str(state), "--password-stdin", stdin="short\n")
        assert short.returncode == 2 and "at least 12" in short.stderr, short.stderr
        removed = run("server", "user", "remove", "bob", "--dir", str(state))
        assert removed.returncode == 0 and "login bob removed" in removed.stdout, removed.stdout + removed.stderr
        assert run("status", "--tracking-uri", url, login=bob).returncode == 2

        # what the sbatch script of a SLURM profile would be: printed by the dry run, no login in it
        dry = run("sweep", *TOY, "--name", "srv", "--cluster", str(REPO / "clusters" / "slurm-local.yaml"),
                  "--tracking-uri", url, "--dry-run")  # fmt: skip
        secret = LOGIN["MLFLOW_TRACKING_PASSWORD"]
        assert secret not in dry.stdout + dry.stderr
        assert secret not in json.dumps(runs)  # the ledger: params, tags
        for password in (secret, bob["MLFLOW_TRACKING_PASSWORD"]):
            leaks = [str(p) for p in (base.rglob("*")) if p.is_file() and password.encode() in p.read_bytes()]
            assert not leaks, f"a password is written in {leaks}"  # job.json, logs, server log, ini, the databases
    finally:
        stopped = run("server", "stop", "--dir", str(state), "--port", str(port))
        assert stopped.returncode == 0 and "PostgreSQL stopped" in stopped.stdout, stopped.stderr
        down = run("server", "status", "--dir", str(state))  # the port its last start recorded
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


# ---------------------------------------------------------------------------
# hostile input: the server's directory, its pid file, the login, the environment
# ---------------------------------------------------------------------------

SHORT = {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "pw-7Hq2-never-in-a-file"}


def _one_line(result, *, code: int = 2) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _user_dir() -> tuple[list[str], dict[str, str], str, Path]:
    """(command prefix, extra environment, home, a fresh directory the user owns), the user being `pdmsrv`
    when the tests run as root."""
    prefix, extra, home = _as_user()
    base = Path(tempfile.mkdtemp(prefix="pdmsrv-", dir="/tmp"))
    if os.geteuid() == 0:
        shutil.chown(base, USER, USER)
    return prefix, extra, home, base


def _as(prefix: list[str], extra: dict[str, str], home: str, *args: str, cwd: Path,
        env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:  # fmt: skip
    full = {"HOME": home, "PATH": os.environ["PATH"], "COLUMNS": "200", **extra, **(env or {})}
    return subprocess.run([*prefix, "-m", "pdmctl.entry", *args], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _sleeper(*, same_user: bool) -> subprocess.Popen:
    """A process that leads a process group of its own, as a server would: the user's (pdmsrv's when the
    tests run as root), or another user's (root's) when `same_user` is false."""
    kwargs: dict = {"start_new_session": True, "stdin": subprocess.DEVNULL}
    if same_user and os.geteuid() == 0:
        kwargs["user"] = USER
    return subprocess.Popen(["sleep", "600"], **kwargs)


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


@pytest.mark.nonroot
@pytest.mark.parametrize("case", ["same user", "same user, another start time", "another user", "pid 1", "pid 0",
                                  "negative", "not a number"])  # fmt: skip
def test_server_stop_signals_no_process_its_directory_did_not_start(case: str) -> None:
    """A pid file that names a process this directory's server is not (a stale file after a reboot, a pid
    reused, another user's process, pid 1 or 0, garbage): `stop` signals nothing, says so in one line, and
    removes the file."""
    prefix, extra, home, base = _user_dir()
    state = base / "s"
    state.mkdir()
    if os.geteuid() == 0:
        shutil.chown(state, USER, USER)
    sleeper = None
    try:
        if case.startswith("same user") or case == "another user":
            if case == "another user" and os.geteuid() != 0:
                text = "1\n"  # init: not this user's
            else:
                sleeper = _sleeper(same_user=case != "another user")
                text = f"{sleeper.pid}\n"
                if case == "same user, another start time":
                    text = f"{sleeper.pid} 1 {_boot_id()}\n"
        else:
            text = {"pid 1": "1\n", "pid 0": "0\n", "negative": "-1\n", "not a number": "$(reboot)\n"}[case]
        (state / "server.pid").write_text(text)
        result = _as(prefix, extra, home, "server", "stop", "--dir", str(state), cwd=base)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stdout + result.stderr
        assert "mlflow server stopped" not in result.stdout
        assert "which is not a server this directory started" in result.stdout, result.stdout
        assert "nothing signalled" in result.stdout and len(result.stdout.strip().splitlines()) == 1
        assert not (state / "server.pid").exists()
        if sleeper is not None:
            assert sleeper.poll() is None, "stop signalled a process its directory did not start"
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        shutil.rmtree(base, ignore_errors=True)


def test_server_stop_on_a_file_says_so_in_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "f"
    afile.write_text("x")
    for action in ("stop", "start"):
        line = _one_line(pdmctl("server", action, "--dir", str(afile), env=SHORT))
        assert f"--dir {afile}: not a directory" in line
    assert afile.read_text() == "x"


SHELL_READS = ["$(touch MARK)", "`touch MARK`", 'a"b', "a'b", "a;b", "a b", "a\nb", "a,b", "a\\b", "a|b", "a&b"]


@pytest.mark.parametrize("name", SHELL_READS)
def test_server_directory_with_a_character_a_shell_reads_is_refused(tmp_path: Path, name: str) -> None:
    from pdmctl.ledger import LedgerError
    from pdmctl.ledger import server as srv

    with pytest.raises(LedgerError, match="not allowed in the server's directory") as refused:
        srv.check_settings(srv.make_settings(tmp_path / name))
    assert "\n" not in str(refused.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("via", ["--dir", "PDMCTL_SERVER_DIR", "XDG_DATA_HOME", "HOME"])
def test_server_start_refuses_a_directory_a_shell_would_read(tmp_path: Path, via: str) -> None:
    """pg_ctl starts postgres through /bin/sh with the directory in it: a directory with a character a
    shell reads is refused in one line, from wherever it comes, and nothing runs or is written."""
    odd = tmp_path / f"$(touch {tmp_path / 'ran'})"
    env = {**SHORT, "PDMCTL_SERVER_DIR": "", "XDG_DATA_HOME": ""}
    args = ["server", "start"]
    if via == "--dir":
        args += ["--dir", str(odd)]
    else:
        env[via] = str(odd)
    line = _one_line(pdmctl(*args, env=env, cwd=tmp_path))
    assert "'$' '(' ')' not allowed in the server's directory (PostgreSQL's pg_ctl passes it through a shell)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(("user", "password", "says"), [
    ("alice", "short-pw", "MLFLOW_TRACKING_PASSWORD has 8 characters: MLflow asks for at least 12"),
    ("ali:ce", "pw-7Hq2-never-in-a-file", "MLFLOW_TRACKING_USERNAME contains ':'"),
    ("alice", "pässwörd-long-enough", "MLFLOW_TRACKING_PASSWORD contains '\\xe4'"),
    ("al\tice", "pw-7Hq2-never-in-a-file", "MLFLOW_TRACKING_USERNAME contains '\\t'"),
    ("alice", "password1234", "MLflow's old default password"),
])  # fmt: skip
def test_server_start_checks_the_login_before_creating_anything(tmp_path: Path, user: str, password: str,
                                                                 says: str) -> None:  # fmt: skip
    """A login MLflow would refuse (or could never check) is refused in one line before the directory,
    PostgreSQL or MLflow exist; the password is not printed."""
    state = tmp_path / "s"
    env = {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}
    result = pdmctl("server", "start", "--dir", str(state), env=env)
    line = _one_line(result)
    assert says in line and password not in result.stdout + result.stderr
    assert not state.exists()


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-5", "0", "1e9", "\u00e9", "600x"])
def test_server_start_timeout_from_the_environment_must_be_a_number_of_seconds(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from pdmctl.ledger import LedgerError
    from pdmctl.ledger import server as srv

    monkeypatch.setenv("PDMCTL_SERVER_START_S", value)
    with pytest.raises(LedgerError, match=r"^PDMCTL_SERVER_START_S=.*: not a number of seconds"):
        srv.start_timeout_s()
    monkeypatch.setenv("PDMCTL_SERVER_START_S", "90")
    assert srv.start_timeout_s() == 90


def test_server_start_timeout_garbage_is_one_line_at_start_and_status_still_works(tmp_path: Path) -> None:
    """PDMCTL_SERVER_START_S set to garbage: `start` says so in one line before anything is created, and
    `status` and `stop`, which do not use it, work."""
    state = tmp_path / "s"
    env = {**SHORT, "PDMCTL_SERVER_START_S": "abc"}
    line = _one_line(pdmctl("server", "start", "--dir", str(state), env=env))
    assert line.startswith("error: PDMCTL_SERVER_START_S=abc: not a number of seconds")
    assert "not a number of seconds" in line and not state.exists()
    status = pdmctl("server", "status", "--dir", str(state), env=env)
    assert status.returncode == 1 and "PostgreSQL: not running" in status.stdout, status.stderr
    stop = pdmctl("server", "stop", "--dir", str(state), env=env)
    assert stop.returncode == 0 and "nothing running" in stop.stdout, stop.stderr


@pytest.mark.nonroot
@pytest.mark.postgres
@pytest.mark.slow  # PostgreSQL's initdb, then MLflow migrates its tables before it binds: about a minute
def test_a_failed_server_start_stops_what_it_started_quotes_its_own_error_and_spares_a_stale_pid() -> None:
    """The port is taken (by a socket that answers no HTTP): MLflow exits while starting. The error quoted
    is this start's (the log holds an earlier start's), PostgreSQL, which this start started, is stopped
    again, and the process a stale pid file named lives on."""
    pytest.importorskip("pgserver")
    prefix, extra, home, base = _user_dir()
    state = base / "s"
    state.mkdir(mode=0o700)
    if os.geteuid() == 0:
        shutil.chown(state, USER, USER)
    (state / "server.log").write_text("Traceback (most recent call last):\nOldError: from an earlier start\n")
    sleeper = _sleeper(same_user=True)
    (state / "server.pid").write_text(f"{sleeper.pid}\n")
    if os.geteuid() == 0:
        for name in ("server.log", "server.pid"):
            shutil.chown(state / name, USER, USER)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = str(holder.getsockname()[1])
    try:
        result = _as(prefix, extra, home, "server", "start", "--dir", str(state), "--port", port, "--workers", "1",
                     cwd=base, env=SHORT)  # fmt: skip
        line = _one_line(result)
        assert "mlflow server exited" in line and "address already in use" in line.lower(), line
        assert "OldError" not in line
        assert line.endswith("(stopped again what this start had started: PostgreSQL)"), line
        assert sleeper.poll() is None, "start signalled the process a stale pid file named"
        status = _as(prefix, extra, home, "server", "status", "--dir", str(state), "--port", port, cwd=base)
        assert status.returncode == 1 and "PostgreSQL: not running" in status.stdout, status.stdout + status.stderr
    finally:
        holder.close()
        sleeper.kill()
        sleeper.wait()
        _as(prefix, extra, home, "server", "stop", "--dir", str(state), cwd=base)
        shutil.rmtree(base, ignore_errors=True)


DIR_TEXT = st.one_of(
    st.sampled_from(["", ".", "..", "s", "a b", "$(id)", "`id`", "a;b", "a\nb", "x" * 300, "/etc/passwd",
                     "/proc/self", "/nonexistent/s", "~", "~nosuchuser/s", "\udcff", "é/s", "f/s", "f"]),  # fmt: skip
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
)
LOGIN_TEXT = st.one_of(st.sampled_from(["", " ", "a:b", "short", "password1234", "ünïcode-password", "tab\there-pw-long",
                                        "pw-7Hq2-never-in-a-file"]),
                       st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                               max_size=16))  # fmt: skip


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(action=st.sampled_from(["start", "stop", "status"]), where=DIR_TEXT, user=LOGIN_TEXT, password=LOGIN_TEXT,
       timeout=st.sampled_from([None, "", "abc", "nan", "-1", "30"]))  # fmt: skip
def test_server_command_contract(tmp_path_factory: pytest.TempPathFactory, action: str, where: str, user: str,
                                 password: str, timeout: str | None) -> None:  # fmt: skip
    """Whatever the directory, the login and PDMCTL_SERVER_START_S: no traceback; `start` (run here only where
    it is refused anyway, as root) exits 2 in one line, the password printed nowhere, nothing written;
    `stop` and `status` answer or exit 2 in one line, and write nothing but their own pid file's removal."""
    if action == "start" and os.geteuid() != 0:
        action = "status"  # as a user, a start that passes every check would start PostgreSQL here
    work = tmp_path_factory.mktemp("srv")
    (work / "f").write_text("a file")
    before = snapshot(work)
    env = {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}
    if timeout is not None:
        env["PDMCTL_SERVER_START_S"] = timeout
    code, stderr = _main(["server", action, "--dir", where, "--port", str(_free_port())], work, env)
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code in ((2,) if action == "start" else (0, 1, 2)), stderr
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    if len(password) >= 6:
        assert password not in stderr
    assert snapshot(work) == before
    shutil.rmtree(work, ignore_errors=True)


def test_server_tls_certificate_and_key_are_checked_before_anything_is_created(tmp_path: Path) -> None:
    state = tmp_path / "s"
    (tmp_path / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    alone = _one_line(pdmctl("server", "start", "--dir", str(state), "--tls-cert", str(tmp_path / "cert.pem"),
                             env=SHORT))  # fmt: skip
    assert "--tls-cert and --tls-key go together" in alone
    line = _one_line(pdmctl("server", "start", "--dir", str(state), "--tls-cert", str(tmp_path / "cert.pem"),
                            "--tls-key", str(tmp_path / "cert.pem"), env=SHORT))  # fmt: skip
    assert "not a certificate and its key" in line
    assert not state.exists()


@pytest.mark.nonroot
@pytest.mark.postgres
@pytest.mark.slow  # a first start: PostgreSQL's initdb and MLflow's tables, about a minute here
def test_server_speaks_tls_with_a_certificate_it_makes_and_clients_trust_it_by_mlflows_variable() -> None:
    """`server start --tls` makes a certificate in DIR/tls and serves HTTPS only; a client that trusts it
    (MLFLOW_TRACKING_SERVER_CERT_PATH, MLflow's own variable) reads the ledger, one that does not is
    refused in one line that names the variable."""
    import ssl

    pytest.importorskip("pgserver")
    prefix, extra, home, base = _user_dir()
    state = base / "s"
    port = str(_free_port())
    url = f"https://127.0.0.1:{port}"
    server = ["server", "start", "--dir", str(state), "--port", port, "--workers", "1", "--tls"]
    try:
        first = _as(prefix, extra, home, *server, cwd=base, env=SHORT)
        assert first.returncode == 0, first.stdout + first.stderr
        cert = state / "tls" / "cert.pem"
        assert f"certificate made: {cert}" in first.stdout and f"mlflow server at {url}" in first.stdout
        assert stat.S_IMODE((state / "tls" / "key.pem").stat().st_mode) == 0o600
        again = _as(prefix, extra, home, *server, cwd=base, env=SHORT)
        assert again.returncode == 0 and "already running" in again.stdout, again.stdout + again.stderr
        assert "certificate made" not in again.stdout
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"{url}/health", timeout=60, context=context) as resp:
            assert resp.status == 200
        with pytest.raises(OSError):  # no plain HTTP on the port: refused, or closed without an answer
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60)
        trusted = _as(prefix, extra, home, "status", "--tracking-uri", url, cwd=base,
                      env={**SHORT, "MLFLOW_TRACKING_SERVER_CERT_PATH": str(cert)})  # fmt: skip
        assert trusted.returncode == 0 and "no runs" in trusted.stdout, trusted.stdout + trusted.stderr
        untrusted = _as(prefix, extra, home, "status", "--tracking-uri", url, cwd=base, env=SHORT)
        line = _one_line(untrusted)
        assert "CERTIFICATE_VERIFY_FAILED" in line and "MLFLOW_TRACKING_SERVER_CERT_PATH" in line
        status = _as(prefix, extra, home, "server", "status", "--dir", str(state), "--port", port, "--tls", cwd=base)
        assert status.returncode == 0 and f"answering at {url}" in status.stdout, status.stdout + status.stderr
    finally:
        stopped = _as(prefix, extra, home, "server", "stop", "--dir", str(state), cwd=base)
        assert stopped.returncode == 0 and "PostgreSQL stopped" in stopped.stdout, stopped.stdout + stopped.stderr
        shutil.rmtree(base, ignore_errors=True)
