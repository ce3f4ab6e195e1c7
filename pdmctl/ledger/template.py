"""A new SQLite store as a copy of an empty one MLflow made on this machine.

MLflow creates a store's schema by running every one of its migrations (about 60 Alembic revisions), after
importing itself: 3-5 s of CPU each time a sweep starts in a fresh folder, and most of a short command's
time. The first creation on a machine is MLflow's own, into pdmctl's cache (one file per MLflow, SQLAlchemy,
Alembic and SQLite version: what decides the schema and its revision stamp); every later new store is that
file copied in with SQLite's backup API (one transaction: a full disk or an interrupt leaves the store
empty, never half made), its default experiment's artifact location and times set for its own place.
MLflow then opens it as one it made: same tables, same revision stamp.

Hand-written rather than MLflow's: MLflow has no way to create a store other than its migrations. Only an
empty file (no table at all) is ever written over; anything else is left to MLflow's own path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import time
from importlib import metadata
from pathlib import Path

from pdmctl.ledger.records import LedgerError

_DISTRIBUTIONS = ("mlflow-skinny", "mlflow", "sqlalchemy", "alembic")


def _key() -> str:
    versions = []
    for name in _DISTRIBUTIONS:
        try:
            versions.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name}=-")
    versions.append(f"sqlite={sqlite3.sqlite_version}")
    return hashlib.sha256(";".join(versions).encode()).hexdigest()[:16]


def template_path() -> Path | None:
    """Where this machine's empty store lives (None: no usable cache directory, so MLflow creates each)."""
    from pdmctl.cache import CacheError, cache_dir

    try:
        return cache_dir(Path.home() / ".cache" / "pdmctl") / "stores" / f"mlflow-{_key()}.db"
    except CacheError:
        return None


def _build(template: Path, make) -> None:
    """MLflow creates the empty store (`make(uri)`) beside the template, which it then replaces whole."""
    template.parent.mkdir(parents=True, exist_ok=True)
    partial = template.with_name(f"{template.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    try:
        make(f"sqlite:///{partial}")
        with contextlib.closing(sqlite3.connect(partial)) as conn:
            conn.execute("PRAGMA journal_mode=DELETE")  # one file, whatever MLflow's engine set
        os.replace(partial, template)
    finally:
        partial.unlink(missing_ok=True)
        _forget_engine(f"sqlite:///{partial}")


def _forget_engine(uri: str) -> None:
    """MLflow keeps an engine per URI for the process's lifetime: the partial file's is of no further use."""
    with contextlib.suppress(Exception):
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        with SqlAlchemyStore._engine_map_lock:
            engine = SqlAlchemyStore._engine_map.pop(uri, None)
        if engine is not None:
            engine.dispose()


def _is_empty(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0


def create_from_template(path: Path, artifact_root: str, make, lock) -> bool:
    """Create the SQLite store at `path` (no table in it yet) from this machine's empty store, building that
    first with `make(uri)` (MLflow's creation) under `lock(template)` if there is none. False: not done (no
    cache directory, or the file holds something), so the caller lets MLflow create it. The caller holds
    the store's creation lock."""
    template = template_path()
    if template is None:
        return False
    try:
        if not template.is_file():
            with lock(template.with_name(template.name + ".lock")):
                if not template.is_file():
                    _build(template, make)
    except (OSError, LedgerError):  # a cache that cannot be written: MLflow creates this store itself
        return False
    now = int(time.time() * 1000)
    try:
        with contextlib.closing(sqlite3.connect(f"file:{template}?mode=ro", uri=True)) as source, \
                contextlib.closing(sqlite3.connect(path, timeout=30)) as store:  # fmt: skip
            if not _is_empty(store):
                return False
            source.backup(store)
            store.execute(
                "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                "WHERE experiment_id = 0",
                (f"{artifact_root}/0", now, now),
            )
            store.commit()
    except sqlite3.Error as exc:
        raise LedgerError(f"tracking store {path}: could not be created ({exc})") from None
    return True
