"""`pdmctl server`: an MLflow tracking server with a login, on a PostgreSQL that runs as the user, no root.

PostgreSQL comes from the `pgserver` wheel (PyPI), which ships the server's binaries (initdb, pg_ctl,
postgres; PostgreSQL 16): `pip install 'pdmctl[server]'`. Everything lives in one directory the user owns
(mode 0700), on a local disk of the host (PostgreSQL on NFS is asking for trouble):

    DIR/pg/         the database cluster (initdb once); databases `mlflow` (runs) and `mlflow_auth` (users)
    DIR/sock/       its Unix socket: PostgreSQL listens on no TCP address, and the directory's mode is the
                    access control (trust within it: only this user can reach the socket)
    DIR/artifacts/  MLflow's artifact store (unless --artifacts names a shared one)
    DIR/basic_auth.ini  MLflow's auth config: where the users live, no password
    DIR/server.pid, DIR/server.log, DIR/pg.log

MLflow runs as its basic-auth app (`mlflow server --app-name basic-auth`): every call but /health needs a
login. The admin login is MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, read from the environment
of `pdmctl server start` and handed to MLflow in its environment (MLFLOW_AUTH_ADMIN_USERNAME/PASSWORD):
never written to a file. The same two variables in the environment of `pdmctl sweep` are what MLflow's
client sends; SLURM passes the submitting environment to the job (sbatch's --export=ALL), so neither the
sbatch script, job.json, the logs nor the ledger hold them.

Every action is idempotent: `start` starts what is not running and checks the login, `stop` stops what
runs, `status` says what runs.
"""

from __future__ import annotations

import configparser
import contextlib
import importlib.util
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from base64 import b64encode
from dataclasses import dataclass
from pathlib import Path

from pdmctl.ledger.records import LedgerError

USER_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
PG_USER = "pdmctl"
PG_PORT = 5432  # only names the socket file: PostgreSQL listens on no TCP port
DATABASES = ("mlflow", "mlflow_auth")
START_TIMEOUT_S = float(os.environ.get("PDMCTL_SERVER_START_S", "600"))  # a first start migrates MLflow's tables
SOCKET_MAX = 107  # sun_path


def default_dir() -> Path:
    env = os.environ.get("PDMCTL_SERVER_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pdmctl" / "server"


@dataclass(frozen=True)
class ServerSettings:
    dir: Path
    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 4
    artifacts: Path | None = None
    allowed_hosts: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pg_data(self) -> Path:
        return self.dir / "pg"

    @property
    def socket_dir(self) -> Path:
        return self.dir / "sock"

    @property
    def pidfile(self) -> Path:
        return self.dir / "server.pid"

    @property
    def log(self) -> Path:
        return self.dir / "server.log"

    @property
    def auth_ini(self) -> Path:
        return self.dir / "basic_auth.ini"

    def store_uri(self, database: str) -> str:
        # no password: the socket directory (0700) is the access control
        return f"postgresql+psycopg2://{PG_USER}@/{database}?host={self.socket_dir}&port={PG_PORT}"


# ---------------------------------------------------------------------------
# checks (one line each, before anything is written)
# ---------------------------------------------------------------------------


def credentials() -> tuple[str, str]:
    user, password = os.environ.get(USER_ENV, ""), os.environ.get(PASSWORD_ENV, "")
    missing = [name for name, value in ((USER_ENV, user), (PASSWORD_ENV, password)) if not value.strip()]
    if missing:
        raise LedgerError(f"pdmctl server: {' and '.join(missing)} not set: the server's login comes from the "
                          "environment (export both, e.g. from a file only you can read), never from a file "
                          "pdmctl writes")  # fmt: skip
    return user, password


def pg_bin() -> Path:
    spec = importlib.util.find_spec("pgserver")  # not imported: its import sets up what we do not use
    if spec is None or not spec.submodule_search_locations:
        raise LedgerError("pdmctl server: the PostgreSQL binaries are not installed (pip install 'pdmctl[server]': "
                          "the pgserver wheel ships them)")  # fmt: skip
    path = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (path / "postgres").is_file():
        raise LedgerError(f"pdmctl server: no postgres binary in {path} (reinstall pgserver)")
    return path


def check_settings(settings: ServerSettings) -> None:
    if os.geteuid() == 0:
        raise LedgerError("pdmctl server: PostgreSQL does not run as root; start the server as the user who "
                          "runs the sweeps (e.g. runuser -u USER -- pdmctl server start)")  # fmt: skip
    if not 1 <= settings.port <= 65535:
        raise LedgerError(f"pdmctl server: --port {settings.port}: not a TCP port")
    if settings.workers < 1:
        raise LedgerError(f"pdmctl server: --workers {settings.workers}: must be >= 1")
    sock = settings.socket_dir / f".s.PGSQL.{PG_PORT}"
    if len(str(sock.resolve() if sock.parent.exists() else sock)) > SOCKET_MAX:
        raise LedgerError(f"pdmctl server: --dir {settings.dir}: too long for a Unix socket path ({sock}, more "
                          f"than {SOCKET_MAX} bytes); choose a shorter directory")  # fmt: skip
    existing = next((p for p in (settings.dir, *settings.dir.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise LedgerError(f"pdmctl server: --dir {settings.dir}: {existing} is not a writable directory")
    if settings.dir.exists() and settings.dir.stat().st_uid != os.geteuid():
        raise LedgerError(f"pdmctl server: --dir {settings.dir}: owned by another user")
    import mlflow.environment_variables as mev

    if not hasattr(mev, "MLFLOW_AUTH_ADMIN_PASSWORD"):
        import mlflow

        raise LedgerError(f"pdmctl server: mlflow {mlflow.__version__} cannot take the admin login from the "
                          "environment (MLFLOW_AUTH_ADMIN_PASSWORD); upgrade it (pip install 'pdmctl[server]')")  # fmt: skip
    if importlib.util.find_spec("flask_wtf") is None:
        raise LedgerError("pdmctl server: MLflow's basic-auth app needs Flask-WTF (pip install 'pdmctl[server]')")


# ---------------------------------------------------------------------------
# PostgreSQL
# ---------------------------------------------------------------------------


def _run(cmd: list[str], what: str, *, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LedgerError(f"pdmctl server: {what}: {exc}") from exc
    if proc.returncode != 0:
        text = (proc.stderr or proc.stdout).strip().splitlines()
        raise LedgerError(f"pdmctl server: {what} failed (exit {proc.returncode}): {text[-1] if text else ''}")
    return proc.stdout


def pg_running(settings: ServerSettings) -> bool:
    if not (settings.pg_data / "PG_VERSION").exists():
        return False
    proc = subprocess.run([str(pg_bin() / "pg_ctl"), "-D", str(settings.pg_data), "status"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return proc.returncode == 0


def start_postgres(settings: ServerSettings) -> list[str]:
    bin_ = pg_bin()
    said = []
    for d in (settings.dir, settings.socket_dir):
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
    if not (settings.pg_data / "PG_VERSION").exists():
        _run([str(bin_ / "initdb"), "-D", str(settings.pg_data), "-U", PG_USER, "-E", "UTF8", "--no-instructions",
              "--auth-local=trust", "--auth-host=reject"], "initdb")  # fmt: skip
        said.append(f"PostgreSQL cluster created in {settings.pg_data}")
    if not pg_running(settings):
        options = f"-c listen_addresses='' -c unix_socket_directories='{settings.socket_dir}' -p {PG_PORT}"
        _run([str(bin_ / "pg_ctl"), "-D", str(settings.pg_data), "-l", str(settings.dir / "pg.log"), "-w",
              "-t", "120", "-o", options, "start"], "pg_ctl start")  # fmt: skip
        said.append("PostgreSQL started")
    psql = [str(bin_ / "psql"), "-h", str(settings.socket_dir), "-p", str(PG_PORT), "-U", PG_USER, "-d", "postgres",
            "-qtAX", "-c"]  # fmt: skip
    for db in DATABASES:
        if _run([*psql, f"SELECT 1 FROM pg_database WHERE datname = '{db}'"], "psql").strip() != "1":
            _run([*psql, f"CREATE DATABASE {db}"], f"CREATE DATABASE {db}")
    return said


def stop_postgres(settings: ServerSettings) -> bool:
    if not pg_running(settings):
        return False
    _run([str(pg_bin() / "pg_ctl"), "-D", str(settings.pg_data), "-m", "fast", "-w", "stop"], "pg_ctl stop")
    return True


# ---------------------------------------------------------------------------
# MLflow
# ---------------------------------------------------------------------------


def _pid(settings: ServerSettings) -> int | None:
    try:
        pid = int(settings.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


def healthy(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except Exception:
        return False


def check_login(url: str, user: str, password: str, timeout: float = 60.0) -> None:
    """The server knows the login (an authenticated call answers 200), and refuses a call without one."""
    api = f"{url}/api/2.0/mlflow/users/get?username={urllib.request.quote(user)}"
    try:
        urllib.request.urlopen(api, timeout=timeout)
        raise LedgerError(f"pdmctl server: {url} answered a call without a login: it is not the basic-auth app "
                          "(another server on this port?)")  # fmt: skip
    except urllib.error.HTTPError as exc:
        if exc.code != 401:
            raise LedgerError(f"pdmctl server: {url} answered {exc.code} to a call without a login") from exc
    except OSError as exc:
        raise LedgerError(f"pdmctl server: {url}: {exc}") from exc
    token = b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(api, headers={"Authorization": f"Basic {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise LedgerError(f"pdmctl server: {url} refused the login of {user} ({exc.code}): the server's admin "
                              f"was created with another name or password; use those, or change it with MLflow's "
                              "update-password call") from exc  # fmt: skip
        raise LedgerError(f"pdmctl server: {url} answered {exc.code} to the login of {user}") from exc
    except OSError as exc:
        raise LedgerError(f"pdmctl server: {url}: {exc}") from exc


def _write_auth_ini(settings: ServerSettings) -> None:
    config = configparser.ConfigParser()
    config["mlflow"] = {
        "default_permission": "READ",  # MLflow's default, for users the admin adds
        "database_uri": settings.store_uri("mlflow_auth"),
        "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
        # a login checked once a minute per worker, not on every call: the check is a PBKDF2 hash (a fraction
        # of a second of CPU), and a sweep's status reads hundreds of metric histories at once; a changed
        # password reaches the other workers within the minute
        "auth_cache_ttl_seconds": "60",
    }
    fd = os.open(settings.auth_ini, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        config.write(fh)


def start(settings: ServerSettings) -> list[str]:
    user, password = credentials()
    check_settings(settings)
    pg_bin()
    said = start_postgres(settings)
    pid = _pid(settings)
    if pid is not None and healthy(settings.url):
        check_login(settings.url, user, password)
        return [*said, f"mlflow server already running at {settings.url} (pid {pid}); login {user} accepted"]
    if pid is not None:  # alive but not answering: a server that hung, or one on another address
        _stop_group(pid)
    if healthy(settings.url):
        raise LedgerError(f"pdmctl server: {settings.url} is answered by a server this directory did not start "
                          "(choose another --port)")  # fmt: skip
    _write_auth_ini(settings)
    artifacts = settings.artifacts or settings.dir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    allowed = settings.allowed_hosts or ",".join(
        dict.fromkeys([settings.host, f"{settings.host}:{settings.port}", "localhost", f"localhost:{settings.port}",
                       "127.0.0.1", f"127.0.0.1:{settings.port}"])  # fmt: skip
    )
    env = {
        **os.environ,
        "MLFLOW_AUTH_CONFIG_PATH": str(settings.auth_ini),
        "MLFLOW_AUTH_ADMIN_USERNAME": user,  # the admin is created on the first start (MLflow's bootstrap)
        "MLFLOW_AUTH_ADMIN_PASSWORD": password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),  # CSRF for the UI, new each start
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # MLflow's GenAI job runner: a dozen idle processes
    }
    cmd = [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth",
           "--backend-store-uri", settings.store_uri("mlflow"), "--artifacts-destination", str(artifacts),
           "--host", settings.host, "--port", str(settings.port), "--workers", str(settings.workers),
           "--allowed-hosts", allowed]  # fmt: skip
    with open(settings.log, "ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=settings.dir)  # fmt: skip
    settings.pidfile.write_text(f"{proc.pid}\n")
    t0 = time.monotonic()
    while not healthy(settings.url):
        if proc.poll() is not None:
            settings.pidfile.unlink(missing_ok=True)
            raise LedgerError(f"pdmctl server: mlflow server exited ({proc.returncode}) while starting: "
                              f"{_last_error(settings.log)} (log: {settings.log})")  # fmt: skip
        if time.monotonic() - t0 > START_TIMEOUT_S:
            _stop_group(proc.pid)
            settings.pidfile.unlink(missing_ok=True)
            raise LedgerError(f"pdmctl server: mlflow server did not answer {settings.url}/health within "
                              f"{START_TIMEOUT_S:.0f} s (log: {settings.log})")  # fmt: skip
        time.sleep(0.5)
    check_login(settings.url, user, password)
    return [*said, f"mlflow server at {settings.url} (pid {proc.pid}, started in {time.monotonic() - t0:.0f} s; "
            f"store: PostgreSQL in {settings.pg_data}, socket only; login {user} accepted)"]  # fmt: skip


def _last_error(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def _stop_group(pid: int, wait_s: float = 30.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait_s:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            # a child of ours (this process started it): reap it, else it stays a zombie in the group
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.2)


def stop(settings: ServerSettings) -> list[str]:
    said = []
    pid = _pid(settings)
    if pid is not None:
        _stop_group(pid)
        said.append(f"mlflow server stopped (pid {pid})")
    settings.pidfile.unlink(missing_ok=True)
    if settings.dir.exists() and stop_postgres(settings):
        said.append("PostgreSQL stopped")
    return said or [f"nothing running in {settings.dir}"]


def status(settings: ServerSettings) -> tuple[bool, list[str]]:
    pid = _pid(settings)
    pg = settings.dir.exists() and pg_running(settings)
    up = pid is not None and healthy(settings.url)
    lines = [
        f"mlflow server: {'answering at ' + settings.url if up else 'not answering at ' + settings.url}"
        + (f" (pid {pid})" if pid is not None else ""),
        f"PostgreSQL: {'running' if pg else 'not running'} ({settings.pg_data})",
    ]
    return up and pg, lines
