"""The ledger: MLflow as the single source of truth for what runs exist and where they stand.

One MLflow experiment per sweep, one MLflow run per RunSpec key in it, each a child of the sweep's parent
run (which holds `pdmctl report`'s files). A handful of readable tags say what a run is and where it stands
(`pdmctl.sweep`, `pdmctl.key`, `pdmctl.mask`, `pdmctl.model`, `pdmctl.precision`, `pdmctl.seed`,
`pdmctl.attempt`, `pdmctl.job_id`); one internal tag, `pdmctl.ledger`, holds the ledger's own record (the
spec, the run's directory, the submission, the provenance: `records`); params carry the flattened config,
the artifact `spec.json` the spec, MLflow's inputs the data sets; the MLflow status is the run's own word
on how it ended. On a tracking server with logins a sweep belongs to the login that created it
(`pdmctl.owner`): another login's sweep, resume, cancel or seeds --submit on it is refused unless the owner
shared it (`pdmctl server share`), and the runs a login other than the owner registered or submitted are
named under `status` and `report` (`login_notes`).

One interface, two stores, as MLflow keeps its own (an abstract store, a SQLAlchemy store, a REST store):

* `records`: the tags, statuses and `RunRecord`; `uris`: which store a URI names and whether it can be
  used; `base`: the `Ledger` interface;
* `sql.SqlLedger` for database stores (the embedded SQLite default, PostgreSQL, MySQL): bulk work
  through SQLAlchemy on MLflow's own tables;
* `client.ClientLedger` for tracking servers (`http://`, `https://`), through `MlflowClient`;
* `logger.RunLogger`: what a job logs into its run;
* `store`: MLflow's client and schema, file locks, SQLite health checks, retries.

Only this package talks to MLflow.
"""

from __future__ import annotations

from pdmctl.ledger.base import Ledger
from pdmctl.ledger.client import ClientLedger
from pdmctl.ledger.logger import RunLogger, load_per_problem, load_samples
from pdmctl.ledger.records import (
    FAILED,
    FINISHED,
    HTTP_TIMEOUT_S,
    KILLED,
    RUNNING,
    SCHEDULED,
    STATUS_METRICS,
    TAG,
    TAG_LOOK,
    TAG_PROVENANCE,
    TERMINAL,
    LedgerError,
    RunRecord,
    Submission,
    SweepOwnerError,
    flatten,
    ledger_tags,
    login_notes,
    metric_value,
    run_dir_of,
    tracking_login,
)
from pdmctl.ledger.sql import SqlLedger
from pdmctl.ledger.store import BUSY_ENV, _file_lock, _lock_path, busy_seconds, close_stores, uri_lock
from pdmctl.ledger.uris import (
    _redact,
    check_reachable,
    check_uri,
    default_tracking_uri,
    is_database_uri,
    ledger_exists,
    resolve_tracking_uri,
    sqlite_path,
)


def open_ledger(uri: str) -> Ledger:
    return SqlLedger(uri) if is_database_uri(uri) else ClientLedger(uri)


def check_owner(uri: str, sweep: str | None, write: bool = True) -> None:
    """On a tracking server with logins, refuse (SweepOwnerError, one line) a sweep that belongs to another
    login: one this login may not change (`write`: sweep, resume, cancel, seeds --submit), or not even read.
    A database store has no logins, hence no owners."""
    if sweep is not None and not is_database_uri(uri):
        open_ledger(uri).check_owner(sweep, write)


__all__ = [
    "BUSY_ENV", "FAILED", "FINISHED", "HTTP_TIMEOUT_S", "KILLED", "RUNNING", "SCHEDULED", "STATUS_METRICS", "TAG",
    "TAG_LOOK", "TAG_PROVENANCE", "TERMINAL", "ClientLedger", "Ledger", "LedgerError", "RunLogger", "RunRecord",
    "SqlLedger", "Submission", "SweepOwnerError", "_file_lock", "_lock_path", "_redact", "busy_seconds", "check_owner",
    "check_reachable", "check_uri", "close_stores", "default_tracking_uri", "flatten", "is_database_uri",
    "ledger_exists", "ledger_tags", "load_per_problem", "load_samples", "login_notes", "metric_value", "open_ledger",
    "resolve_tracking_uri", "run_dir_of", "sqlite_path", "tracking_login", "uri_lock",
]  # fmt: skip
