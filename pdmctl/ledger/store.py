"""The store underneath: MLflow's client and schema, file locks, SQLite health checks (a file that is
not SQLite, truncated, busy) and retries."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import shutil
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

from pdmctl.ledger.records import LedgerError
from pdmctl.ledger.template import create_from_template
from pdmctl.ledger.uris import _first_line, _redact, sqlite_path

log = logging.getLogger(__name__)


def _mlflow_client(uri: str):
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # importing mlflow resets it to INFO
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def _mlflow_store(uri: str, locked: bool = False) -> None:
    """Let MLflow create (or migrate) the schema of a new database store (`locked`: the caller holds
    the creation lock)."""
    path = sqlite_path(uri)
    root = (path.parent / "mlartifacts").as_uri() if path else "./mlartifacts"

    def create() -> None:
        if path is not None and create_from_template(path, root, _mlflow_creates, _file_lock):
            return  # a copy of the empty store MLflow made on this machine (pdmctl.ledger.template)
        _mlflow_creates(uri, root)

    if locked:
        create()
        return
    with _file_lock(_lock_path(uri).with_suffix(".init")):
        create()


def _mlflow_creates(uri: str, root: str = "./mlartifacts") -> None:
    """MLflow's own creation of a store: its tables, by running every one of its migrations."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # importing mlflow resets it to INFO
    logging.getLogger("alembic").setLevel(logging.WARNING)
    SqlAlchemyStore(uri, root)


def _mlflow_table_names() -> set[str]:
    """Every table MLflow's schema has (its ORM models), with alembic's version table."""
    import mlflow.store.db.utils  # noqa: F401  (imports every model into Base.metadata)
    from mlflow.store.db.base_sql_model import Base

    return {*Base.metadata.tables, "alembic_version"}


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a+")  # noqa: SIM115 (closed below)
    except OSError as exc:  # a file where the directory goes, a read-only cache
        raise LedgerError(f"lock {path}: {exc.strerror or exc} (where pdmctl serialises submissions)") from None
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_ENGINES: weakref.WeakSet = weakref.WeakSet()  # every SqlLedger's engine, closed when a command ends


def close_stores() -> None:
    """Close every store connection this process holds. The last connection to close a SQLite store in
    WAL mode removes its -wal/-shm files: a command that only read the store leaves it as it found it."""
    for engine in list(_ENGINES):
        with contextlib.suppress(Exception):
            engine.dispose()


BUSY_ENV = "PDMCTL_STORE_BUSY_S"  # how long a command waits for another writer's lock on a SQLite store


def busy_seconds() -> float:
    try:
        value = float(os.environ.get(BUSY_ENV, "60"))
    except ValueError:
        value = 60.0
    return value if math.isfinite(value) and value >= 0 else 60.0


def _holders(path: Path | None) -> str:
    """Who has a SQLite store open, as far as /proc tells this user: "pid N: command", or ''."""
    if path is None:
        return ""
    names = {str(path), f"{path}-wal", f"{path}-shm"}
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        if proc.name == str(os.getpid()):
            continue
        try:
            if any(os.readlink(fd) in names for fd in (proc / "fd").iterdir()):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                found.append(f"pid {proc.name}: {cmd[:80]}")
        except OSError:
            continue
    return "; ".join(found[:3]) + (f"; {len(found) - 3} more" if len(found) > 3 else "")


def _check_sqlite_file(path: Path) -> None:
    """Refuse a file that is not SQLite, or shorter than its header says (truncated), reading 100 bytes.

    The header's page count holds only while its "version-valid-for" field matches the change
    counter (https://www.sqlite.org/fileformat.html#in_header_database_size). A live store grows
    while it is read (a job's write, a WAL checkpoint): the size is taken after the header, and a
    short file is called truncated only if it stays so, unchanged, over a few reads.
    """
    if path.stat().st_size == 0:  # SQLite makes an empty file a new database
        return
    wal = path.with_name(path.name + "-wal")
    wal_pages = wal.exists() and wal.stat().st_size > 32  # frames past the WAL's 32-byte header
    seen: tuple[int, int] | None = None
    for attempt in range(8):
        header = _read_header(path)
        size = path.stat().st_size
        if len(header) < 100 or not header.startswith(b"SQLite format 3\0"):
            raise LedgerError(f"tracking store {path}: not a usable MLflow database (not an SQLite file)")
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(header[28:32], "big")
        if not (pages and header[24:28] == header[92:96] and size < page_size * pages):
            return
        if wal_pages:  # committed pages not yet copied back live in the -wal (SQLite reads them there)
            return
        if seen == (size, page_size * pages) and attempt >= 3:
            raise LedgerError(f"tracking store {path}: not a usable MLflow database (truncated: {size} bytes "
                              f"of {page_size * pages})")  # fmt: skip
        seen = (size, page_size * pages)
        time.sleep(0.05 * (attempt + 1))
    raise LedgerError(f"tracking store {path}: not a usable MLflow database (truncated: {size} bytes "
                      f"of {page_size * pages})")  # fmt: skip


def _read_header(path: Path) -> bytes:
    # Read by another process: closing any descriptor of a SQLite file drops every POSIX lock this
    # process holds on it (SQLite's own and MLflow's connections included), and a WAL connection that
    # loses its shared lock lets another process reset the WAL under it ("database disk image is
    # malformed", seen with `sweep --wait`).
    # coreutils' head wherever PATH has it, else this Python (a PATH without /usr/bin, as a job's may be)
    head = shutil.which("head", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"]))
    command = [head, "-c", "100", "--", str(path)] if head else \
        [sys.executable, "-c", "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read(100))", str(path)]
    read = subprocess.run(command, capture_output=True, check=False)
    if read.returncode != 0:
        why = (read.stderr.decode(errors="replace").strip().splitlines() or ["head failed"])[-1]
        raise LedgerError(f"tracking store {path}: cannot be read ({why})")
    return read.stdout


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers (status) never block the jobs' writers
    cur.execute(f"PRAGMA busy_timeout={int(busy_seconds() * 1000)}")
    cur.close()


def _retry(fn, *, attempts: int = 12, first_wait: float = 0.1):
    """SQLite allows one writer at a time; a busy store is waited out, not lost."""
    wait = first_wait
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:
            text = str(exc).lower()
            transient = "locked" in text or "busy" in text or "timeout" in text or "connection" in text
            if not transient or i == attempts - 1:
                raise
            log.warning("tracking store busy (%s); retrying in %.1fs", _first_line(exc), wait)
            time.sleep(wait)
            wait = min(wait * 2, 5.0)
    return None


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _now_ms() -> int:
    return int(time.time() * 1000)



def _local_root(location: str | None) -> Path | None:
    """A run's artifact root as a directory of this machine (`file:` or a plain path), else None."""
    from urllib.parse import unquote, urlparse

    if not location:
        return None
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    return Path(location) if parsed.scheme == "" else None


def put_artifacts(uri: str, run_id: str, location: str | None, items: Sequence[tuple[str, str | Path]]) -> None:
    """Write artifacts into a run: (path in the run, text or a local file) each. A root on this machine (the
    embedded store's `mlartifacts/`) is written directly, as MLflow's local artifact repository writes it,
    without importing MLflow; any other through MLflow's client (a server's artifact proxy, object storage)."""
    root = _local_root(location)
    if root is not None:
        for name, content in items:
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                shutil.copyfile(content, target)
            else:
                target.write_text(content)
        return
    client = _mlflow_client(uri)
    for name, content in items:
        if isinstance(content, Path):
            folder = str(Path(name).parent)
            _retry(lambda c=content, f=folder: client.log_artifact(run_id, str(c), None if f == "." else f))
        else:
            _retry(lambda c=content, n=name: client.log_text(run_id, c, n))


def _lock_path(uri: str) -> Path:
    path = sqlite_path(uri)
    if path is not None:
        return path.with_name(path.name + ".pdmctl.lock")
    from pdmctl.cache import CacheError, cache_dir

    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    try:
        return cache_dir(Path.home() / ".cache" / "pdmctl") / "locks" / f"{digest}.lock"
    except CacheError as exc:
        raise LedgerError(f"the submission lock of {_redact(uri)}: {exc}") from None


def uri_lock(uri: str) -> contextlib.AbstractContextManager[None]:
    """An exclusive lock on a store, across processes: beside a SQLite file, else in pdmctl's cache."""
    return _file_lock(_lock_path(uri))

