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
import json
import math
import os
import re
import secrets
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from base64 import b64encode
from dataclasses import dataclass
from pathlib import Path

from pdmctl.ledger import tls
from pdmctl.ledger.bind import is_wildcard, netloc, reachable_name
from pdmctl.ledger.records import LedgerError
from pdmctl.ledger.uris import CERT_ENV, tls_context

USER_ENV, PASSWORD_ENV = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
PG_USER = "pdmctl"
PG_PORT = 5432  # only names the socket file: PostgreSQL listens on no TCP port
DATABASES = ("mlflow", "mlflow_auth")
START_ENV = "PDMCTL_SERVER_START_S"
START_TIMEOUT_S = 600.0  # a first start migrates MLflow's tables
SOCKET_MAX = 107  # sun_path
PASSWORD_MIN = 12  # MLflow's minimum (mlflow.utils.validation._validate_password)
# pg_ctl starts postgres through /bin/sh with the data directory in double quotes: only these characters
# reach it as themselves (letters and digits of any script, and a few punctuation marks)
SAFE_DIR = re.compile(r"[\w./+@%=:~-]+")


def start_timeout_s() -> float:
    """How long `start` waits for MLflow to answer: $PDMCTL_SERVER_START_S, read when a start needs it."""
    raw = os.environ.get(START_ENV, "")
    if not raw.strip():
        return START_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 7 * 86400):
        raise LedgerError(f"{START_ENV}={shown(raw)}: not a number of seconds in (0, 604800] (how long "
                          f"`pdmctl server start` waits for MLflow to answer; unset, it is {START_TIMEOUT_S:.0f})")  # fmt: skip
    return value


def shown(text: object) -> str:
    """Text as printed in a one-line message: as it is if printable, else escaped (no newline, no raw byte)."""
    text = str(text)
    return text if text.isprintable() else ascii(text)


def default_dir() -> Path:
    env = os.environ.get("PDMCTL_SERVER_DIR")
    try:
        if env:
            return Path(env).expanduser()
        base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    except RuntimeError as exc:  # ~user of no user, or no home
        raise LedgerError(f"pdmctl server: no server directory ({exc}); pass --dir") from None
    return Path(base) / "pdmctl" / "server"


def make_settings(directory: Path | None, **options: object) -> ServerSettings:
    """The settings of one `pdmctl server` call: --dir (or the default) as an absolute path."""
    try:
        path = (directory or default_dir()).expanduser().absolute()
    except (RuntimeError, OSError) as exc:  # ~nosuchuser; a working directory that was removed
        raise LedgerError(f"pdmctl server: --dir {shown(directory)}: {exc}") from None
    return ServerSettings(dir=path, **options)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ServerSettings:
    dir: Path
    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 4
    artifacts: Path | None = None
    allowed_hosts: str | None = None
    tls: bool = False  # HTTPS with DIR/tls/cert.pem and key.pem (made on the first start unless given)
    tls_cert: Path | None = None  # a certificate (PEM) and its key the user gives instead
    tls_key: Path | None = None

    @property
    def url(self) -> str:
        """Where this machine reaches the server (the bind address; a wildcard reaches this machine's own)."""
        return f"{'https' if self.serves_tls else 'http'}://{netloc(self.host)}:{self.port}"

    @property
    def profile_uri(self) -> str:
        """The tracking_uri a cluster profile names: the bind address, or for a wildcard bind (0.0.0.0, ::),
        which names no address a node can reach, this host's name (`reachable_name`)."""
        host = reachable_name() if is_wildcard(self.host) else self.host
        return f"{'https' if self.serves_tls else 'http'}://{netloc(host)}:{self.port}"

    @property
    def serves_tls(self) -> bool:
        return self.tls or self.tls_cert is not None

    @property
    def cert(self) -> Path | None:
        return (self.tls_cert or self.dir / "tls" / "cert.pem") if self.serves_tls else None

    @property
    def key(self) -> Path | None:
        return (self.tls_key or self.dir / "tls" / "key.pem") if self.serves_tls else None

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
    check_login_text(user, password)
    return user, password


def check_login_text(user: str, password: str, user_env: str = USER_ENV, password_env: str = PASSWORD_ENV) -> None:
    """A login MLflow can create and its client can send, checked before anything is created: MLflow's
    client sends it as Latin-1 and its server reads UTF-8 (only ASCII means the same to both), HTTP basic
    auth splits it at the first ':', and MLflow refuses a password under 12 characters, but only once
    PostgreSQL and MLflow have started."""
    for name, value in ((user_env, user), (password_env, password)):
        odd = next((ch for ch in value if not (ch.isascii() and ch.isprintable())), None)
        if odd is not None:
            raise LedgerError(f"pdmctl server: {name} contains {odd!a}: only printable ASCII reaches the "
                              "server as typed (MLflow's client sends the login as Latin-1, its server reads "
                              "UTF-8)")  # fmt: skip
    if ":" in user:
        raise LedgerError(f"pdmctl server: {user_env} contains ':': HTTP basic auth splits the login at the first "
                          "':', so this user could never log in; choose a name without it")  # fmt: skip
    if len(password) < PASSWORD_MIN:
        raise LedgerError(f"pdmctl server: {password_env} has {len(password)} characters: MLflow asks for at least "
                          f"{PASSWORD_MIN}")  # fmt: skip
    if password == "password1234":
        raise LedgerError(f"pdmctl server: {password_env} is MLflow's old default password, which it refuses; "
                          "choose another")  # fmt: skip


def check_tls_pair(settings: ServerSettings) -> None:
    """--tls-cert and --tls-key: both, and a certificate its key matches (PEM)."""
    if settings.tls_cert is None or settings.tls_key is None:
        raise LedgerError("pdmctl server: --tls-cert and --tls-key go together (a certificate and its key, PEM)")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise LedgerError(f"pdmctl server: --tls-cert {shown(settings.tls_cert)} --tls-key {shown(settings.tls_key)}: "
                          f"not a certificate and its key ({shown(exc)})") from None  # fmt: skip


def make_certificate(settings: ServerSettings) -> bool:
    """DIR/tls/cert.pem (self-signed, for the bind address, localhost and this host's names) and key.pem
    (mode 0600), unless both exist: True when made. The clients trust it with
    MLFLOW_TRACKING_SERVER_CERT_PATH=DIR/tls/cert.pem (copied where the nodes read it)."""
    assert settings.cert is not None and settings.key is not None
    return tls.self_signed(settings.cert, settings.key, settings.host)


def check_dir(settings: ServerSettings, action: str) -> None:
    """--dir, before anything is written, signalled or read: a directory (or nothing yet), this user's unless
    only its status is asked; for a start, a path no shell reads differently (pg_ctl runs postgres through
    /bin/sh with it)."""
    where = f"pdmctl server: --dir {shown(settings.dir)}"
    if action == "start":
        odd = sorted({ch for ch in str(settings.dir) if not SAFE_DIR.fullmatch(ch)})
        if odd:
            raise LedgerError(f"{where}: {' '.join(ascii(ch) for ch in odd)} not allowed in the server's "
                              "directory (PostgreSQL's pg_ctl passes it through a shell); choose one of letters, "
                              "digits and . _ - / + @ % = : ~")  # fmt: skip
    try:
        info = settings.dir.stat()
    except FileNotFoundError:
        return
    except OSError as exc:  # a path through a file (ENOTDIR), a loop of links, no permission
        raise LedgerError(f"{where}: {exc.strerror or exc}") from None
    if not settings.dir.is_dir():
        raise LedgerError(f"{where}: not a directory")
    if info.st_uid != os.geteuid() and action != "status":
        raise LedgerError(f"{where}: owned by another user (uid {info.st_uid})"
                          + (": pdmctl stops only a server you started" if action == "stop" else ""))


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
    check_dir(settings, "start")
    if settings.tls_cert is not None or settings.tls_key is not None:
        check_tls_pair(settings)
    if os.geteuid() == 0:
        raise LedgerError("pdmctl server: PostgreSQL does not run as root; start the server as the user who "
                          "runs the sweeps (e.g. runuser -u USER -- pdmctl server start)")  # fmt: skip
    if not 1 <= settings.port <= 65535:
        raise LedgerError(f"pdmctl server: --port {settings.port}: not a TCP port")
    if settings.workers < 1:
        raise LedgerError(f"pdmctl server: --workers {settings.workers}: must be >= 1")
    sock = settings.socket_dir / f".s.PGSQL.{PG_PORT}"
    try:
        sock = sock.resolve() if sock.parent.exists() else sock
    except (RuntimeError, OSError) as exc:  # a loop of links
        raise LedgerError(f"pdmctl server: --dir {shown(settings.dir)}: {exc}") from None
    if len(str(sock)) > SOCKET_MAX:
        raise LedgerError(f"pdmctl server: --dir {shown(settings.dir)}: too long for a Unix socket path ({shown(sock)}, more "
                          f"than {SOCKET_MAX} bytes); choose a shorter directory")  # fmt: skip
    existing = next((p for p in (settings.dir, *settings.dir.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise LedgerError(f"pdmctl server: --dir {shown(settings.dir)}: {shown(existing)} is not a writable "
                          "directory")  # fmt: skip
    if settings.artifacts is not None:
        found = next((p for p in (settings.artifacts, *settings.artifacts.parents) if p.exists()), None)
        if found is None or not found.is_dir() or not os.access(found, os.W_OK | os.X_OK):
            raise LedgerError(f"pdmctl server: --artifacts {shown(settings.artifacts)}: {shown(found)} is not a "
                              "writable directory")  # fmt: skip
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


def _identity(pid: int) -> str | None:
    """What tells this process from any other that ever had its pid: the boot and the start time (clock
    ticks since boot, /proc/PID/stat's 22nd field); None if no such process, or not this user's."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        owner = os.stat(f"/proc/{pid}").st_uid
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    if owner != os.geteuid():
        return None
    return f"{stat[stat.rindex(')') + 2:].split()[19]} {boot}"


def _write_pidfile(settings: ServerSettings, pid: int) -> None:
    identity = _identity(pid)
    settings.pidfile.write_text(f"{pid} {identity}\n" if identity else f"{pid}\n")


def _pid(settings: ServerSettings) -> tuple[int | None, str | None]:
    """(pid of the MLflow server this directory started, if it runs; a line on a pid file that names no such
    process). A pid is this server's only if the process has the start time and boot the file recorded, or,
    for a file of the pid alone, runs `mlflow server` on this directory's socket; never pid 0 or 1."""
    try:
        text = settings.pidfile.read_text(errors="replace")
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{shown(settings.pidfile)}: {exc.strerror or exc}; nothing signalled"
    fields = text.split()
    numeric = bool(fields) and fields[0].isascii() and fields[0].isdigit() and len(fields[0]) <= 12
    pid = int(fields[0]) if numeric else 0
    if pid > 1 and len(fields) > 1:
        ours = _identity(pid) == " ".join(fields[1:])
    elif pid > 1:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            argv = []
        ours = (_identity(pid) is not None and b"mlflow" in argv and b"server" in argv
                and any(str(settings.socket_dir).encode() in a for a in argv))  # fmt: skip
    else:
        ours = False
    if ours:
        return pid, None
    named = f"pid {pid}" if numeric else (shown(text.strip()[:40]) or "nothing")
    return None, (f"{shown(settings.pidfile)} names {named}, which is not a server this directory started (a stale "
                  "file): nothing signalled")  # fmt: skip


def healthy(url: str, timeout: float = 3.0, cafile: Path | None = None) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout, context=tls_context(cafile)) as resp:
            return resp.status == 200
    except Exception:
        return False


def check_login(url: str, user: str, password: str, timeout: float = 60.0, cafile: Path | None = None) -> None:
    """The server knows the login (an authenticated call answers 200), and refuses a call without one."""
    api = f"{url}/api/2.0/mlflow/users/get?username={urllib.request.quote(user)}"
    context = tls_context(cafile)
    try:
        urllib.request.urlopen(api, timeout=timeout, context=context)
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
        with urllib.request.urlopen(request, timeout=timeout, context=context):
            return
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise LedgerError(f"pdmctl server: {url} refused the login of {user} ({exc.code}): the server's admin "
                              f"was created with another name or password; use those, or change it with MLflow's "
                              "update-password call") from exc  # fmt: skip
        raise LedgerError(f"pdmctl server: {url} answered {exc.code} to the login of {user}") from exc
    except OSError as exc:
        raise LedgerError(f"pdmctl server: {url}: {exc}") from exc


def _record_start(settings: ServerSettings) -> None:
    """Where this start serves (DIR/server.json, no secret): `status`, `stop` and `user` find it there."""
    record = {"host": settings.host, "port": settings.port, "tls": settings.tls,
              "tls_cert": str(settings.tls_cert or ""), "tls_key": str(settings.tls_key or "")}  # fmt: skip
    tmp = settings.dir / "server.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(settings.dir / "server.json")


def last_start(settings: ServerSettings) -> dict:
    """What the directory's last start recorded (empty when none, or unreadable: the defaults then apply)."""
    try:
        record = json.loads((settings.dir / "server.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    ok = {"host": str, "port": int, "tls": bool, "tls_cert": str, "tls_key": str}
    return {k: v for k, v in record.items() if k in ok and type(v) is ok[k]}


def _write_auth_ini(settings: ServerSettings) -> None:
    config = configparser.ConfigParser()
    config["mlflow"] = {
        "default_permission": "NO_PERMISSIONS",  # a login sees others' sweeps only where they share them
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
    timeout_s = start_timeout_s()
    check_settings(settings)
    pg_bin()
    pg_was_running = pg_running(settings)
    started: list[int] = []  # the MLflow server this start started, to stop if the start fails
    try:
        return _start(settings, user, password, timeout_s, started)
    except BaseException as exc:  # a Ctrl-C while MLflow starts too
        undone = []
        for pid in started:
            with contextlib.suppress(LedgerError, OSError):
                _stop_group(pid)
                settings.pidfile.unlink(missing_ok=True)
                undone.append("mlflow server")
        if not pg_was_running:
            with contextlib.suppress(LedgerError, OSError):
                if stop_postgres(settings):
                    undone.append("PostgreSQL")
        if not isinstance(exc, (LedgerError, OSError)):
            raise
        error = exc if isinstance(exc, LedgerError) else LedgerError(f"pdmctl server: {shown(exc)}")
        if undone:
            error = LedgerError(f"{error} (stopped again what this start had started: {' and '.join(undone)})")
        raise error from None


def _start(settings: ServerSettings, user: str, password: str, timeout_s: float, started: list[int]) -> list[str]:
    said = start_postgres(settings)
    pid, note = _pid(settings)
    if note:
        said.append(note)
        settings.pidfile.unlink(missing_ok=True)
    if settings.tls and settings.tls_cert is None and make_certificate(settings):
        said.append(f"certificate made: {shown(settings.cert)} (the clients trust it with {CERT_ENV})")
    if pid is not None and healthy(settings.url, cafile=settings.cert):
        check_login(settings.url, user, password, cafile=settings.cert)
        return [*said, f"mlflow server already running at {settings.url} (pid {pid}); login {user} accepted"]
    if pid is not None:  # alive but not answering: a server that hung, or one on another address
        _stop_group(pid)
    if healthy(settings.url, cafile=settings.cert) or healthy(settings.url.replace("https://", "http://")):
        raise LedgerError(f"pdmctl server: {settings.url} is answered by a server this directory did not start "
                          "(choose another --port)")  # fmt: skip
    _write_auth_ini(settings)
    artifacts = settings.artifacts or settings.dir / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    names = [netloc(settings.host), "localhost", "127.0.0.1"]
    if is_wildcard(settings.host):  # the name the profile's tracking_uri gives the nodes (`profile_uri`)
        names += [netloc(reachable_name()), socket.gethostname()]
    allowed = settings.allowed_hosts or ",".join(
        dict.fromkeys(n for name in names if name for n in (name, f"{name}:{settings.port}"))
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
    if settings.serves_tls:
        cmd += ["--uvicorn-opts", shlex.join(["--ssl-certfile", str(settings.cert), "--ssl-keyfile", str(settings.key)])]
    with open(settings.log, "ab") as log:
        offset = log.tell()  # this start's output begins here: the log keeps earlier starts' too
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=settings.dir)  # fmt: skip
    started.append(proc.pid)
    _write_pidfile(settings, proc.pid)
    t0 = time.monotonic()
    while not healthy(settings.url, cafile=settings.cert):
        if proc.poll() is not None:
            started.remove(proc.pid)
            settings.pidfile.unlink(missing_ok=True)
            raise LedgerError(f"pdmctl server: mlflow server exited ({proc.returncode}) while starting: "
                              f"{_last_error(settings.log, offset)} (log: {shown(settings.log)})")  # fmt: skip
        if time.monotonic() - t0 > timeout_s:
            raise LedgerError(f"pdmctl server: mlflow server did not answer {settings.url}/health within "
                              f"{timeout_s:.0f} s ({START_ENV}; log: {shown(settings.log)})")  # fmt: skip
        time.sleep(0.5)
    check_login(settings.url, user, password, cafile=settings.cert)
    _record_start(settings)
    return [*said, f"mlflow server at {settings.url} (pid {proc.pid}, started in {time.monotonic() - t0:.0f} s; "
            f"store: PostgreSQL in {shown(settings.pg_data)}, socket only; login {user} accepted)"]  # fmt: skip


def _last_error(log: Path, offset: int = 0) -> str:
    """The error of the output that begins at `offset` (this start's): its last line naming an error or an
    exception, in any case, other than the traceback's own lines; else its last line."""
    try:
        with open(log, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return "no log"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    quoted = [ln for ln in lines if re.search(r"error|exception|fatal", ln, re.IGNORECASE)
              and not ln.startswith(("Traceback", "File ", "raise ", "^")) and "CalledProcessError" not in ln]  # fmt: skip
    chosen = quoted[-1] if quoted else (lines[-1] if lines else "no output")
    return shown(chosen[:300])


def _stop_group(pid: int, wait_s: float = 30.0) -> None:
    """Stop the MLflow server `pid` (checked by `_pid`) and its workers: its process group, which it leads
    (started in a session of its own); the process alone if it leads none."""
    if pid <= 1:
        raise LedgerError(f"pdmctl server: refusing to signal pid {pid}")
    try:
        group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return
    send = os.killpg if group else os.kill
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            send(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError as exc:
            raise LedgerError(f"pdmctl server: cannot signal the mlflow server (pid {pid}): {exc.strerror}") from None
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait_s:
            try:
                send(pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                return  # the group's members are gone and the pid is someone else's
            # a child of ours (this process started it): reap it, else it stays a zombie in the group
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.2)


def stop(settings: ServerSettings) -> list[str]:
    check_dir(settings, "stop")
    if not settings.dir.exists():
        return [f"nothing running in {shown(settings.dir)}"]
    said = []
    pid, note = _pid(settings)
    if note:
        said.append(note)
    if pid is not None:
        _stop_group(pid)
        said.append(f"mlflow server stopped (pid {pid})")
    with contextlib.suppress(OSError):
        settings.pidfile.unlink(missing_ok=True)
    if stop_postgres(settings):
        said.append("PostgreSQL stopped")
    return said or [f"nothing running in {shown(settings.dir)}"]


def status(settings: ServerSettings) -> tuple[bool, list[str]]:
    check_dir(settings, "status")
    pid, note = _pid(settings)
    pg = settings.dir.is_dir() and pg_running(settings)
    up = pid is not None and healthy(settings.url, cafile=settings.cert)
    lines = [
        f"mlflow server: {'answering at ' + settings.url if up else 'not answering at ' + settings.url}"
        + (f" (pid {pid})" if pid is not None else ""),
        f"PostgreSQL: {'running' if pg else 'not running'} ({shown(settings.pg_data)})",
        *([note] if note else []),
    ]
    return up and pg, lines
