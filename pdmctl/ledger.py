"""The ledger: MLflow as the single source of truth for what runs exist and where they stand.

One MLflow experiment per sweep, one MLflow run per RunSpec key in it. Tags
carry the identity (`pdmctl.key`, `pdmctl.sweep`), the executor's job id, the
attempt count and the spec itself; params carry the flattened config; the
MLflow status is the run's own word on how it ended.

Two implementations behind one interface:

* `SqlLedger` for database stores (the embedded SQLite default, PostgreSQL,
  MySQL). MLflow creates and migrates the schema; bulk work (registering a
  1,000-run grid, reading a sweep's state, metric histories for a report) goes
  through SQLAlchemy on MLflow's own tables in a few statements instead of one
  REST-shaped call per run.
* `ClientLedger` for tracking servers (`http://`, `https://`), through
  `MlflowClient`, with a thread pool where MLflow has no bulk call.

Only this module talks to MLflow.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import json
import logging
import math
import os
import subprocess
import sys
import time
import uuid
import weakref
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pdmctl.spec import RunSpec

log = logging.getLogger(__name__)

TAG = "pdmctl."
TAG_SWEEP, TAG_KEY, TAG_BACKEND = "pdmctl.sweep", "pdmctl.key", "pdmctl.backend"
TAG_JOB, TAG_EXECUTOR, TAG_ATTEMPT = "pdmctl.job_id", "pdmctl.executor", "pdmctl.attempt"
TAG_SPEC, TAG_SUMMARY, TAG_RUN_DIR, TAG_REASON = (
    "pdmctl.spec",
    "pdmctl.summary",
    "pdmctl.run_dir",
    "pdmctl.reason",
)
# a submission ("token:index:attempt") is recorded before its job goes out, and confirmed once the
# ledger (or the job itself) knows the job id; one not confirmed is looked up in the executor
TAG_SUBMISSION, TAG_SUBMITTED = "pdmctl.submission", "pdmctl.submitted"
TAG_NOTICE = "pdmctl.notice"  # what the current attempt wants the user to know (status shows it)
RUN_NAME_TAG = "mlflow.runName"
USER_TAG = "mlflow.user"

# MLflow run statuses
SCHEDULED, RUNNING, FINISHED, FAILED, KILLED = "SCHEDULED", "RUNNING", "FINISHED", "FAILED", "KILLED"
TERMINAL = frozenset({FINISHED, FAILED, KILLED})

# latest values read for `status` (step and avg@16)
STATUS_METRICS = ("train/reward", "eval/toy24", "eval/toy25", "eval/aime24", "eval/aime25")
HTTP_TIMEOUT_S = 5.0  # a tracking server that has not answered by then is reported unreachable
_PARAM_VALUE_MAX = 6000  # MLflow's limit on a param value
_TAG_VALUE_MAX = 8000


class LedgerError(RuntimeError):
    """The tracking store cannot be reached or used; the message is one line."""


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    sweep: str
    key: str
    status: str  # MLflow's
    attempt: int
    job_id: str | None
    executor: str | None
    spec_json: str | None
    summary: str
    run_dir: str | None
    reason: str | None
    start_time: int | None
    end_time: int | None
    latest: dict[str, tuple[int, float]] = field(default_factory=dict)  # metric -> (step, value)
    submission: str | None = None
    submitted: str | None = None
    notice: str | None = None

    @property
    def pending_submission(self) -> str | None:
        """The submission whose job id the ledger has not recorded (an interrupted submit), if any."""
        return self.submission if self.submission and self.submission != self.submitted else None

    @property
    def spec(self) -> RunSpec | None:
        """The run's spec; None where none is recorded or the record cannot be read (an older pdmctl cut
        long specs at MLflow's tag limit)."""
        if not self.spec_json:
            return None
        try:
            return RunSpec.from_json(self.spec_json)
        except (ValueError, KeyError, TypeError):
            return None

    @property
    def step(self) -> int | None:
        steps = [s for s, _ in self.latest.values()]
        return max(steps) if steps else None

    @property
    def avg16(self) -> float | None:
        """Latest held-out avg@16, averaged over the eval sets present."""
        values = [v for k, (_, v) in self.latest.items() if k.startswith("eval/")]
        return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Submission:
    run_id: str
    job_id: str
    executor: str
    attempt: int
    submission: str = ""  # "token:index:attempt", as in the intent


def default_tracking_uri(cwd: Path | None = None) -> str:
    return f"sqlite:///{(cwd or Path.cwd()).resolve() / 'mlflow.db'}"


def resolve_tracking_uri(cli_uri: str | None, profile_uri: str | None) -> str:
    """--tracking-uri, then MLFLOW_TRACKING_URI, then the cluster profile, then ./mlflow.db; checked."""
    if cli_uri is not None and not cli_uri.strip():  # `--tracking-uri "$UNSET"`: not ./mlflow.db by surprise
        raise LedgerError("--tracking-uri: empty (an unset variable?); give a URI, or leave the option out "
                          "for the default")  # fmt: skip
    uri = cli_uri or os.environ.get("MLFLOW_TRACKING_URI") or profile_uri or default_tracking_uri()
    check_uri(uri)
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):  # make relative paths absolute
        try:
            uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
        except (RuntimeError, OSError) as exc:  # a loop of symbolic links
            raise LedgerError(f"tracking URI {uri}: cannot be resolved ({exc})") from exc
    return uri


def check_uri(uri: str) -> None:
    """Raise LedgerError (one line) for a URI no store answers to; looks at the text only."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0]
    if scheme == "sqlite":
        if not uri.startswith("sqlite:///") or not uri.removeprefix("sqlite:///").strip("/"):
            raise LedgerError(f"tracking URI {uri}: a SQLite store is sqlite:///PATH (three slashes, "
                              "then the file; four for an absolute path)")  # fmt: skip
    elif scheme in ("http", "https"):
        if not parsed.hostname:
            raise LedgerError(f"tracking URI {uri}: no host")
    elif not is_database_uri(uri):
        raise LedgerError(
            f"tracking URI {_redact(uri)}: unsupported scheme {parsed.scheme!r} "
            "(use sqlite:///, postgresql://, http://)"
        )


def is_database_uri(uri: str) -> bool:
    return urlparse(uri).scheme.split("+")[0] in ("sqlite", "postgresql", "mysql", "mssql")


def sqlite_path(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def check_reachable(uri: str, *, timeout: float = 5.0) -> None:
    """Raise LedgerError (one line) unless the store can be used; writes nothing."""
    scheme = urlparse(uri).scheme
    path = sqlite_path(uri)
    if path is not None:
        if not path.parent.is_dir():
            raise LedgerError(f"tracking URI {uri}: directory {path.parent} does not exist")
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise LedgerError(f"tracking URI {uri}: {path} is not writable")
        return
    if is_database_uri(uri):
        import sqlalchemy

        try:
            engine = sqlalchemy.create_engine(uri, connect_args=_connect_args(uri, timeout))
        except ImportError as exc:
            hint = ("name one that is, e.g. postgresql+psycopg2:// (pip install 'pdmctl[cluster]')"
                    if uri.startswith("postgresql") else "install it")  # fmt: skip
            raise LedgerError(f"tracking URI {_redact(uri)}: its database driver is not installed "
                              f"({_first_line(exc)}); {hint}") from exc  # fmt: skip
        except Exception as exc:
            raise LedgerError(f"tracking URI {_redact(uri)}: cannot be used ({_first_line(exc)})") from exc
        try:
            with engine.connect() as conn:
                conn.execute(sqlalchemy.text("SELECT 1"))
        except Exception as exc:
            raise LedgerError(f"tracking URI {_redact(uri)}: cannot connect ({_first_line(exc)})") from exc
        return
    if scheme in ("http", "https"):
        import urllib.request

        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as resp:
                if resp.status != 200:
                    raise LedgerError(f"tracking URI {uri}: /health answered {resp.status}")
        except LedgerError:
            raise
        except Exception as exc:
            raise LedgerError(f"tracking URI {uri}: not reachable ({_first_line(exc)})") from exc
        return
    check_uri(uri)


def open_ledger(uri: str) -> Ledger:
    return SqlLedger(uri) if is_database_uri(uri) else ClientLedger(uri)


def ledger_exists(uri: str) -> bool:
    """Whether reading the ledger would find anything (an absent SQLite file has no runs yet).

    A SQLite store whose directory is missing is a mistaken path, not an empty store: LedgerError.
    """
    path = sqlite_path(uri)
    if path is not None and not path.parent.is_dir():
        raise LedgerError(f"tracking URI {uri}: directory {path.parent} does not exist")
    return path is None or path.exists()


# ---------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------


class Ledger:
    uri: str

    def runs(self, sweep: str | None = None) -> list[RunRecord]:
        raise NotImplementedError

    def register(self, specs: Sequence[RunSpec], run_dir: Mapping[str, str]) -> dict[str, str]:
        """Create a SCHEDULED run for every spec whose key the sweep lacks; return key -> run id for all.

        `run_dir`: key -> the directory that holds that key's runs; each run's own directory in it is
        named by its run id (see `run_dir_of`).
        """
        if not specs:
            return {}
        existing = {r.key: r.run_id for r in self.runs(specs[0].sweep)}
        new = [s for s in specs if s.key not in existing]
        if new:
            existing.update(self._create_runs(specs[0].sweep, new, run_dir))
        return existing

    def _create_runs(
        self, sweep: str, specs: Sequence[RunSpec], run_dir: Mapping[str, str]
    ) -> dict[str, str]:
        raise NotImplementedError

    def mark_intent(self, submissions: Mapping[str, str], executor: str) -> None:
        """Record, per run id, the submission about to go out (before the executor sees it)."""
        raise NotImplementedError

    def mark_submitted(self, submissions: Sequence[Submission]) -> None:
        raise NotImplementedError

    def set_status(
        self, run_ids: Sequence[str], status: str, reason: str | None = None, *, only_unfinished: bool = False
    ) -> None:
        """Set the MLflow status (and the reason tag); `only_unfinished` leaves runs that already ended."""
        raise NotImplementedError

    def metric_histories(
        self, run_ids: Sequence[str], keys: Sequence[str] | None = None
    ) -> dict[str, dict[str, list[tuple[int, float]]]]:
        """run id -> metric -> [(step, value)] sorted by step."""
        raise NotImplementedError

    def sweeps(self) -> list[str]:
        return sorted({r.sweep for r in self.runs()})

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Serialise sweep/resume submissions so that concurrent invocations submit each run once."""
        return uri_lock(self.uri)


def uri_lock(uri: str) -> contextlib.AbstractContextManager[None]:
    """An exclusive lock on a store, across processes: beside a SQLite file, else in pdmctl's cache."""
    return _file_lock(_lock_path(uri))


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


def run_dir_of(parent: str, run_id: str) -> str:
    return str(Path(parent) / run_id)


def _tags_for(spec: RunSpec, run_dir: str) -> dict[str, str]:
    return {
        RUN_NAME_TAG: spec.run_name,
        USER_TAG: getpass.getuser(),
        TAG_SWEEP: spec.sweep,
        TAG_KEY: spec.key,
        TAG_BACKEND: spec.backend,
        TAG_ATTEMPT: "0",
        **spec_tags(spec.to_json()),
        TAG_SUMMARY: spec.summary[:_TAG_VALUE_MAX],
        TAG_RUN_DIR: run_dir,
    }


def spec_tags(spec_json: str) -> dict[str, str]:
    """A spec of any length as tags within MLflow's limit on a tag's value: `pdmctl.spec` holds the
    first part, `pdmctl.spec.1`, `pdmctl.spec.2`, ... the rest (the config round-trips whole)."""
    parts = [spec_json[i : i + _TAG_VALUE_MAX] for i in range(0, len(spec_json), _TAG_VALUE_MAX)] or [""]
    return {TAG_SPEC if i == 0 else f"{TAG_SPEC}.{i}": part for i, part in enumerate(parts)}


def _spec_json(tags: Mapping[str, str]) -> str | None:
    first = tags.get(TAG_SPEC)
    if first is None:
        return None
    parts, i = [first], 1
    while (part := tags.get(f"{TAG_SPEC}.{i}")) is not None:
        parts.append(part)
        i += 1
    return "".join(parts)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Params: the config flattened to dotted keys (`mask.method`, `delta`, ...)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{name}."))
        else:
            out[name] = (json.dumps(v) if isinstance(v, list) else str(v))[:_PARAM_VALUE_MAX]
    return out


def metric_value(value: Any, is_nan: Any = False) -> float:
    """A metric as it was logged. MLflow stores NaN as 0 with is_nan set, and ±inf as ±sys.float_info.max
    (is_nan unset); both are non-finite again here, never a huge number that would be averaged."""
    if is_nan:
        return math.nan
    number = float(value)
    return math.copysign(math.inf, number) if abs(number) >= sys.float_info.max else number


def _record(run_id: str, status: str, start: int | None, end: int | None, tags: Mapping[str, str],
            latest: dict[str, tuple[int, float]]) -> RunRecord:  # fmt: skip
    return RunRecord(
        run_id=run_id,
        sweep=tags.get(TAG_SWEEP, ""),
        key=tags.get(TAG_KEY, ""),
        status=status,
        attempt=int(tags.get(TAG_ATTEMPT) or 0),
        job_id=tags.get(TAG_JOB) or None,
        executor=tags.get(TAG_EXECUTOR) or None,
        spec_json=_spec_json(tags),
        summary=tags.get(TAG_SUMMARY, ""),
        run_dir=tags.get(TAG_RUN_DIR),
        reason=tags.get(TAG_REASON) or None,
        start_time=start,
        end_time=end,
        latest=latest,
        submission=tags.get(TAG_SUBMISSION) or None,
        submitted=tags.get(TAG_SUBMITTED) or None,
        notice=tags.get(TAG_NOTICE) or None,
    )


# ---------------------------------------------------------------------------
# Database stores
# ---------------------------------------------------------------------------


_LEDGER_TABLES = ("experiments", "experiment_tags", "runs", "tags", "params", "latest_metrics", "metrics")


class SqlLedger(Ledger):
    def __init__(self, uri: str) -> None:
        import sqlalchemy

        self.uri = uri
        self._sa = sqlalchemy
        path = sqlite_path(uri)
        if path is not None and path.exists():
            _check_sqlite_file(path)  # before connecting: SQLite's WAL pragma would add files beside it
        if path is None:  # a server database: its driver and the server answer, or one line says which not
            check_reachable(uri, timeout=HTTP_TIMEOUT_S)
        self.engine = sqlalchemy.create_engine(uri, connect_args=_connect_args(uri, busy_seconds()))
        _ENGINES.add(self.engine)
        if uri.startswith("sqlite"):
            sqlalchemy.event.listen(self.engine, "connect", _sqlite_pragmas)
        with self._usable():
            self._ensure_schema()
            self.meta = sqlalchemy.MetaData()
            self.meta.reflect(self.engine, only=list(_LEDGER_TABLES))
        self.t = self.meta.tables
        self.queries = 0  # statements issued (the report benchmark prints it)

    @contextlib.contextmanager
    def _usable(self) -> Iterator[None]:
        """A file that is not an MLflow database (corrupt, truncated, something else) is one line."""
        try:
            yield
        except self._sa.exc.DatabaseError as exc:
            where = sqlite_path(self.uri) or _redact(self.uri)
            if "locked" in str(exc).lower() or "busy" in str(exc).lower():  # busy, not broken
                held = _holders(sqlite_path(self.uri))
                raise LedgerError(
                    f"tracking store {where}: busy: another process has held its write lock for "
                    f"{busy_seconds():g} s{f' ({held})' if held else ''}; try again when it is done"
                ) from exc
            raise LedgerError(
                f"tracking store {where}: not a usable MLflow database ({_first_line(exc.orig or exc)})"
            ) from exc
        except KeyError as exc:  # reflect() found a database without MLflow's tables
            where = sqlite_path(self.uri) or _redact(self.uri)
            raise LedgerError(f"tracking store {where}: not an MLflow database (no table {exc})") from exc
        except self._sa.exc.InvalidRequestError as exc:  # reflect(): some of MLflow's tables are missing
            where = sqlite_path(self.uri) or _redact(self.uri)
            missing = _first_line(exc).rsplit(":", 1)[-1].strip()
            raise LedgerError(f"tracking store {where}: not a whole MLflow database (no table {missing})") from exc

    def _ensure_schema(self) -> None:
        names = set(self._sa.inspect(self.engine).get_table_names())
        if "runs" not in names:
            _mlflow_store(self.uri)  # MLflow creates its tables and stamps its migration version
        elif not set(_LEDGER_TABLES) <= names and (path := sqlite_path(self.uri)) is not None:
            self._finish_cut_short_creation(path)

    def _finish_cut_short_creation(self, path: Path) -> None:
        """A SQLite store with some of MLflow's tables and no run: its creation was cut short (the disk
        filled while MLflow created the schema; MLflow cannot finish it: its migrations are stamped
        before their DDL is done). It holds nothing recorded, so it is moved aside whole and created
        afresh. Under the creation lock, so a creation in progress elsewhere is never taken for one."""
        with _file_lock(_lock_path(self.uri).with_suffix(".init")):
            with self.engine.connect() as conn:
                names = set(self._sa.inspect(conn).get_table_names())
                if set(_LEDGER_TABLES) <= names:
                    return  # another process finished it meanwhile
                own = _mlflow_table_names()
                foreign = sorted(n for n in names if n not in own and not n.startswith("_alembic_tmp_"))
                recorded = conn.execute(self._sa.text("SELECT count(*) FROM runs")).scalar()
            if foreign or recorded:
                return  # not an interrupted creation: reflect() refuses it in one line
            self.engine.dispose()  # no connection keeps the old file open: ours, nor MLflow's cached one
            from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

            with SqlAlchemyStore._engine_map_lock:
                cached = SqlAlchemyStore._engine_map.pop(self.uri, None)
            if cached is not None:
                cached.dispose()
            aside = path.with_name(f"{path.name}.incomplete-{time.strftime('%Y%m%d-%H%M%S')}")
            for suffix in ("", "-wal", "-shm"):
                old = path.with_name(path.name + suffix)
                if old.exists():
                    old.rename(aside.with_name(aside.name + suffix))
            print(f"pdmctl: tracking store {path}: its creation had been cut short (no run in it); "
                  f"moved aside to {aside.name} and created afresh", file=sys.stderr)
            _mlflow_store(self.uri, locked=True)

    # -- reading --------------------------------------------------------------------------

    def runs(self, sweep: str | None = None) -> list[RunRecord]:
        sa, t = self._sa, self.t
        runs, tags, latest = t["runs"], t["tags"], t["latest_metrics"]
        ids = sa.select(tags.c.run_uuid).where(tags.c.key == TAG_SWEEP)
        if sweep is not None:
            ids = ids.where(tags.c.value == sweep)
        with self._usable(), self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(runs.c.run_uuid, runs.c.status, runs.c.start_time, runs.c.end_time).where(
                    runs.c.run_uuid.in_(ids), runs.c.lifecycle_stage == "active"
                )
            ).all()
            tag_rows = conn.execute(
                sa.select(tags.c.run_uuid, tags.c.key, tags.c.value).where(
                    tags.c.run_uuid.in_(ids), tags.c.key.like(f"{TAG}%")
                )
            ).all()
            metric_rows = conn.execute(
                sa.select(
                    latest.c.run_uuid, latest.c.key, latest.c.step, latest.c.value, latest.c.is_nan
                ).where(latest.c.run_uuid.in_(ids), latest.c.key.in_(STATUS_METRICS))
            ).all()
        self.queries += 3
        run_tags: dict[str, dict[str, str]] = defaultdict(dict)
        for run_id, key, value in tag_rows:
            run_tags[run_id][key] = value
        run_latest: dict[str, dict[str, tuple[int, float]]] = defaultdict(dict)
        for run_id, key, step, value, is_nan in metric_rows:  # MLflow stores NaN as 0 with is_nan set
            run_latest[run_id][key] = (int(step), metric_value(value, is_nan))
        return [_record(r[0], r[1], r[2], r[3], run_tags[r[0]], run_latest[r[0]]) for r in rows]

    def metric_histories(self, run_ids, keys=None):
        sa, metrics = self._sa, self.t["metrics"]
        out: dict[str, dict[str, list[tuple[int, float]]]] = {rid: defaultdict(list) for rid in run_ids}
        with self._usable(), self.engine.connect() as conn:
            for chunk in _chunks(list(run_ids), 500):
                query = sa.select(
                    metrics.c.run_uuid, metrics.c.key, metrics.c.step, metrics.c.value, metrics.c.is_nan
                ).where(metrics.c.run_uuid.in_(chunk))
                if keys is not None:
                    query = query.where(metrics.c.key.in_(list(keys)))
                for run_id, key, step, value, is_nan in conn.execute(query):
                    out[run_id][key].append((int(step), metric_value(value, is_nan)))
                self.queries += 1
        for per_run in out.values():
            for series in per_run.values():
                series.sort()
        return {rid: dict(v) for rid, v in out.items()}

    # -- writing --------------------------------------------------------------------------

    def _create_runs(self, sweep, specs, run_dir):
        with self._usable():
            return self._insert_runs(sweep, specs, run_dir)

    def _insert_runs(self, sweep, specs, run_dir):
        exp_id, artifact_root = self._experiment(sweep)
        now = _now_ms()
        user = getpass.getuser()
        run_rows, tag_rows, param_rows, created = [], [], [], {}
        for spec in specs:
            run_id = uuid.uuid4().hex
            created[spec.key] = run_id
            run_rows.append(dict(
                run_uuid=run_id, name=spec.run_name, source_type="UNKNOWN", source_name="", entry_point_name="",
                user_id=user, status=SCHEDULED, start_time=now, end_time=None, source_version="",
                lifecycle_stage="active", artifact_uri=f"{artifact_root.rstrip('/')}/{run_id}/artifacts",
                experiment_id=exp_id, deleted_time=None,
            ))  # fmt: skip
            tag_rows += [
                dict(key=k, value=v, run_uuid=run_id)
                for k, v in _tags_for(spec, run_dir_of(run_dir[spec.key], run_id)).items()
            ]
            param_rows += [dict(key=k, value=v, run_uuid=run_id) for k, v in flatten(spec.config).items()]
        run_cols = set(self.t["runs"].c.keys())
        with self.engine.begin() as conn:
            conn.execute(
                self.t["runs"].insert(), [{k: v for k, v in r.items() if k in run_cols} for r in run_rows]
            )
            conn.execute(self.t["tags"].insert(), tag_rows)
            conn.execute(self.t["params"].insert(), param_rows)
        self.queries += 3
        return created

    def mark_submitted(self, submissions):
        if not submissions:
            return
        rows = []
        for s in submissions:
            rows += [dict(key=TAG_JOB, value=s.job_id, run_uuid=s.run_id),
                     dict(key=TAG_EXECUTOR, value=s.executor, run_uuid=s.run_id),
                     dict(key=TAG_ATTEMPT, value=str(s.attempt), run_uuid=s.run_id),
                     dict(key=TAG_REASON, value="", run_uuid=s.run_id),
                     dict(key=TAG_SUBMITTED, value=s.submission, run_uuid=s.run_id)]  # fmt: skip
        ids = [s.run_id for s in submissions]
        with self._usable(), self.engine.begin() as conn:
            self._replace_tags(conn, ids, rows)
            self._update_status(conn, ids, SCHEDULED, end_time=None)

    def mark_intent(self, submissions, executor):
        rows = []
        for run_id, submission in submissions.items():
            rows += [dict(key=TAG_SUBMISSION, value=submission, run_uuid=run_id),
                     dict(key=TAG_EXECUTOR, value=executor, run_uuid=run_id)]  # fmt: skip
        with self._usable(), self.engine.begin() as conn:
            self._replace_tags(conn, list(submissions), rows)

    def _replace_tags(self, conn, run_ids: list[str], rows: list[dict[str, str]]) -> None:
        tags = self.t["tags"]
        keys = sorted({r["key"] for r in rows})
        for chunk in _chunks(run_ids, 500):
            conn.execute(tags.delete().where(tags.c.run_uuid.in_(chunk), tags.c.key.in_(keys)))
        if rows:
            conn.execute(tags.insert(), rows)

    def set_status(self, run_ids, status, reason=None, *, only_unfinished=False):
        if not run_ids:
            return
        tags, runs = self.t["tags"], self.t["runs"]
        with self._usable(), self.engine.begin() as conn:
            if only_unfinished:  # a job may have reported its end since the caller looked
                ended = {r for (r,) in conn.execute(self._sa.select(runs.c.run_uuid).where(
                    runs.c.run_uuid.in_(list(run_ids)), runs.c.status.in_(list(TERMINAL))))}  # fmt: skip
                run_ids = [r for r in run_ids if r not in ended]
                if not run_ids:
                    return
            self._update_status(
                conn, list(run_ids), status, end_time=_now_ms() if status in TERMINAL else None
            )
            if reason is not None:
                for chunk in _chunks(list(run_ids), 500):
                    conn.execute(tags.delete().where(tags.c.run_uuid.in_(chunk), tags.c.key == TAG_REASON))
                conn.execute(tags.insert(), [dict(key=TAG_REASON, value=reason, run_uuid=r) for r in run_ids])

    def _update_status(self, conn, run_ids: list[str], status: str, end_time: int | None) -> None:
        runs = self.t["runs"]
        for chunk in _chunks(run_ids, 500):
            conn.execute(
                runs.update().where(runs.c.run_uuid.in_(chunk)).values(status=status, end_time=end_time)
            )
        self.queries += 1

    def _create_experiment(self, sweep: str) -> None:
        """An MLflow experiment row, as MLflow's own store writes one (no mlflow import on this path)."""
        sa, exps = self._sa, self.t["experiments"]
        path = sqlite_path(self.uri)
        root = (path.parent / "mlartifacts").as_uri() if path else "mlflow-artifacts:"
        now = _now_ms()
        row = dict(name=sweep, artifact_location=None, lifecycle_stage="active", creation_time=now,
                   last_update_time=now, workspace="default")  # fmt: skip
        try:
            with self.engine.begin() as conn:
                exp_id = conn.execute(
                    exps.insert().values(**{k: v for k, v in row.items() if k in exps.c})
                ).inserted_primary_key[0]
                conn.execute(exps.update().where(exps.c.experiment_id == exp_id)
                             .values(artifact_location=f"{root}/{exp_id}"))  # fmt: skip
                if "experiment_tags" in self.t:
                    conn.execute(self.t["experiment_tags"].insert().values(key="pdmctl", value="sweep",
                                                                           experiment_id=exp_id))  # fmt: skip
        except sa.exc.IntegrityError:
            pass  # another process created it first

    def _experiment(self, sweep: str) -> tuple[int, str]:
        sa, exps = self._sa, self.t["experiments"]
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(exps.c.experiment_id, exps.c.artifact_location, exps.c.lifecycle_stage).where(
                    exps.c.name == sweep
                )
            ).first()
        if row is None:
            self._create_experiment(sweep)
            return self._experiment(sweep)
        if row[2] != "active":
            raise LedgerError(f"sweep {sweep!r}: its MLflow experiment is deleted; restore or purge it first")
        return int(row[0]), str(row[1])


# ---------------------------------------------------------------------------
# Tracking servers
# ---------------------------------------------------------------------------


def _server_call(method):
    """A tracking server that fails a call (500, a hung API past the timeout, a dropped connection) is one
    line naming the server and the first line of what went wrong, never MLflow's traceback."""
    import functools

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except LedgerError:
            raise
        except Exception as exc:
            raise LedgerError(f"tracking server {_redact(self.uri)}: {method.__name__.strip('_')} failed "
                              f"({_first_line(exc)[:300]})") from exc  # fmt: skip

    return call


class ClientLedger(Ledger):
    def __init__(self, uri: str) -> None:
        check_reachable(uri, timeout=HTTP_TIMEOUT_S)
        # MLflow's own defaults retry a dead server for minutes (and a hung one for as long): a command
        # answers within seconds, its first failed call one line (`_server`)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(HTTP_TIMEOUT_S)))
        self.uri = uri
        self.client = _mlflow_client(uri)
        self.queries = 0

    def _experiment_ids(self, sweep: str | None) -> list[str]:
        if sweep is not None:
            exp = self.client.get_experiment_by_name(sweep)
            return [exp.experiment_id] if exp else []
        return [
            e.experiment_id for e in self.client.search_experiments(filter_string="tags.pdmctl = 'sweep'")
        ]

    def _search(self, sweep: str | None):
        ids = self._experiment_ids(sweep)
        if not ids:
            return []
        filt = f"tags.`{TAG_SWEEP}` = '{sweep}'" if sweep else f"tags.`{TAG_SWEEP}` LIKE '%'"
        runs, token = [], None
        while True:
            page = self.client.search_runs(ids, filt, max_results=5000, page_token=token)
            self.queries += 1
            runs += list(page)
            token = page.token
            if not token:
                return runs

    @_server_call
    def runs(self, sweep=None):
        out = []
        for run in self._search(sweep):
            tags = {k: v for k, v in run.data.tags.items() if k.startswith(TAG)}
            latest = {}
            for key in STATUS_METRICS:
                if key in run.data.metrics:
                    latest[key] = (self._latest_step(run, key), metric_value(run.data.metrics[key]))
            out.append(
                _record(
                    run.info.run_id, run.info.status, run.info.start_time, run.info.end_time, tags, latest
                )
            )
        return out

    def _latest_step(self, run, key: str) -> int:
        hist = self.client.get_metric_history(run.info.run_id, key)
        self.queries += 1
        return max((m.step for m in hist), default=0)

    @_server_call
    def _create_runs(self, sweep, specs, run_dir):
        from mlflow.entities import Param, RunTag

        exp_id = self._ensure_experiment(sweep)

        def create(spec: RunSpec) -> tuple[str, str]:
            tags = {k: v for k, v in _tags_for(spec, "").items() if k != TAG_RUN_DIR}  # named by the run id
            run = self.client.create_run(exp_id, run_name=spec.run_name, tags=tags)
            run_tags = [
                RunTag(TAG_KEY, spec.key),
                RunTag(TAG_RUN_DIR, run_dir_of(run_dir[spec.key], run.info.run_id)),
            ]
            params = [Param(k, v) for k, v in flatten(spec.config).items()]
            for chunk in _chunks(params, 100):
                self.client.log_batch(run.info.run_id, params=chunk, tags=run_tags)
            self.client.update_run(run.info.run_id, status=SCHEDULED)
            return spec.key, run.info.run_id

        with ThreadPoolExecutor(16) as pool:
            return dict(pool.map(create, specs))

    def _ensure_experiment(self, sweep: str) -> str:
        exp = self.client.get_experiment_by_name(sweep)
        if exp is not None:
            if exp.lifecycle_stage != "active":
                raise LedgerError(
                    f"sweep {sweep!r}: its MLflow experiment is deleted; restore or purge it first"
                )
            return exp.experiment_id
        try:
            return self.client.create_experiment(sweep, tags={"pdmctl": "sweep"})
        except Exception:
            exp = self.client.get_experiment_by_name(sweep)
            if exp is None:
                raise
            return exp.experiment_id

    @_server_call
    def mark_submitted(self, submissions):
        from mlflow.entities import RunTag

        def mark(s: Submission) -> None:
            self.client.log_batch(s.run_id, tags=[RunTag(TAG_JOB, s.job_id), RunTag(TAG_EXECUTOR, s.executor),
                                                  RunTag(TAG_ATTEMPT, str(s.attempt)), RunTag(TAG_REASON, ""),
                                                  RunTag(TAG_SUBMITTED, s.submission)])  # fmt: skip
            self.client.update_run(s.run_id, status=SCHEDULED)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(mark, submissions))

    @_server_call
    def mark_intent(self, submissions, executor):
        from mlflow.entities import RunTag

        def mark(item: tuple[str, str]) -> None:
            run_id, submission = item
            self.client.log_batch(
                run_id, tags=[RunTag(TAG_SUBMISSION, submission), RunTag(TAG_EXECUTOR, executor)]
            )

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(mark, submissions.items()))

    @_server_call
    def set_status(self, run_ids, status, reason=None, *, only_unfinished=False):
        def update(run_id: str) -> None:
            if only_unfinished and self.client.get_run(run_id).info.status in TERMINAL:
                return
            if reason is not None:
                self.client.set_tag(run_id, TAG_REASON, reason)
            if status in TERMINAL:
                self.client.set_terminated(run_id, status=status)
            else:
                self.client.update_run(run_id, status=status)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(update, run_ids))

    @_server_call
    def metric_histories(self, run_ids, keys=None):
        def one(run_id: str) -> tuple[str, dict[str, list[tuple[int, float]]]]:
            names = keys if keys is not None else list(self.client.get_run(run_id).data.metrics)
            return run_id, {
                k: sorted((m.step, metric_value(m.value)) for m in self.client.get_metric_history(run_id, k))
                for k in names
            }

        with ThreadPoolExecutor(16) as pool:
            result = dict(pool.map(one, run_ids))
        self.queries += len(run_ids) * (len(keys) if keys else 1)
        return {rid: {k: v for k, v in per.items() if v} for rid, per in result.items()}


# ---------------------------------------------------------------------------
# What a job uses: log into one run
# ---------------------------------------------------------------------------


class RunLogger:
    """The Tracker a job hands its backend: MLflow metrics into the ledger's run.

    On a resumed attempt the backend replays the steps after its checkpoint;
    points already in the run (same metric, step <= the last logged step) are
    skipped, so every step appears once.
    """

    def __init__(self, uri: str, run_id: str) -> None:
        self.client = _mlflow_client(uri)
        self.uri = uri
        self.run_id = run_id
        self.last_logged: dict[str, int] = {}  # metric -> last step already in the run

    def start(self, attempt: int, job_id: str, executor: str, submission: str = "") -> None:
        from mlflow.entities import RunTag

        # the job confirms its own submission: the ledger knows its id even if the submitter was interrupted
        tags = [RunTag(TAG_ATTEMPT, str(attempt)), RunTag(TAG_JOB, job_id), RunTag(TAG_EXECUTOR, executor),
                RunTag(TAG_REASON, ""), RunTag(TAG_SUBMITTED, submission), RunTag(TAG_NOTICE, "")]  # fmt: skip
        _retry(lambda: self.client.log_batch(self.run_id, tags=tags))
        _retry(lambda: self.client.update_run(self.run_id, status=RUNNING))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        for name in metrics:
            if name not in self.last_logged:
                hist = _retry(lambda n=name: self.client.get_metric_history(self.run_id, n))
                self.last_logged[name] = max((m.step for m in hist), default=-1)
        now = _now_ms()
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if step > self.last_logged[k]]
        for chunk in _chunks(batch, 500):
            _retry(lambda c=chunk: self.client.log_batch(self.run_id, metrics=c))
        for m in batch:
            self.last_logged[m.key] = step

    def log_per_problem(self, dataset: str, step: int, accuracies: Sequence[float]) -> None:
        _retry(lambda: self.client.log_dict(self.run_id, {"step": step, "dataset": dataset,
                                                          "accuracies": [float(a) for a in accuracies]},
                                            f"per_problem/{dataset}/step_{step:07d}.json"))  # fmt: skip

    def copy_metrics(self, rename) -> dict[str, float]:
        """Log every metric another writer put into this run under `rename(name)` (skipping None).

        VeRL logs into the run with its own names; the report reads pdmctl's.
        Returns the last value of each renamed metric.
        """
        run = _retry(lambda: self.client.get_run(self.run_id))
        final: dict[str, float] = {}
        for name in run.data.metrics:
            new = rename(name)
            if new is None or new == name:
                continue
            for m in sorted(
                _retry(lambda n=name: self.client.get_metric_history(self.run_id, n)), key=lambda m: m.step
            ):
                self.log_metrics({new: m.value}, m.step)
                final[new] = m.value
        return final

    def notice(self, message: str) -> None:
        print(f"pdmctl job: {message}", flush=True)  # the job's stdout is the run's log
        _retry(lambda: self.client.set_tag(self.run_id, TAG_NOTICE, message[:_TAG_VALUE_MAX]))

    def finish(self, status: str, reason: str | None = None) -> None:
        if reason is not None:
            _retry(lambda: self.client.set_tag(self.run_id, TAG_REASON, reason[:_TAG_VALUE_MAX]))
        _retry(lambda: self.client.set_terminated(self.run_id, status=status))


def load_per_problem(uri: str, run_id: str, dataset: str) -> dict[int, list[float]]:
    """step -> per-problem accuracies of one run's evaluations (for the two-level bootstrap)."""
    client = _mlflow_client(uri)
    out: dict[int, list[float]] = {}
    try:
        files = client.list_artifacts(run_id, f"per_problem/{dataset}")
    except Exception:
        return out
    for f in files:
        data = client.load_dict(run_id, f.path) if hasattr(client, "load_dict") else None
        if data is None:
            import mlflow.artifacts

            data = json.loads(Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=f.path,
                                                                      tracking_uri=uri)).read_text())  # fmt: skip
        out[int(data["step"])] = [float(a) for a in data["accuracies"]]
    return out


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _mlflow_client(uri: str):
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow import MlflowClient

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # importing mlflow resets it to INFO
    logging.getLogger("alembic").setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def _mlflow_store(uri: str, locked: bool = False) -> None:
    """Let MLflow create (or migrate) the schema of a new database store (`locked`: the caller holds
    the creation lock)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    path = sqlite_path(uri)
    root = (path.parent / "mlartifacts").as_uri() if path else "./mlartifacts"
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # importing mlflow resets it to INFO
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if locked:
        SqlAlchemyStore(uri, root)
        return
    with _file_lock(_lock_path(uri).with_suffix(".init")):
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


def _connect_args(uri: str, timeout: float) -> dict[str, Any]:
    if uri.startswith("sqlite"):
        return {"timeout": timeout}
    if uri.startswith("postgresql"):
        return {"connect_timeout": int(timeout)}
    return {}


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
    read = subprocess.run(["head", "-c", "100", "--", str(path)], capture_output=True, check=False)
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _redact(uri: str) -> str:
    parsed = urlparse(uri)
    if parsed.password:
        return uri.replace(f":{parsed.password}@", ":***@")
    return uri
