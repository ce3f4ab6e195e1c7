"""`SqlLedger`: database stores (the embedded SQLite default, PostgreSQL, MySQL) through SQLAlchemy on
MLflow's own tables: bulk work in a few statements instead of one REST-shaped call per run. MLflow
creates and migrates the schema.

Where pdmctl writes SQL into MLflow's tables, and why not through MLflow's API:

* registering runs (`_insert_runs`, and a sweep's parent run): rows of `runs`, `tags` and `params` in one
  transaction, and a new sweep's row of `experiments` and `experiment_tags`;
* submitting, ending and adopting runs (`mark_intent`, `mark_submitted`, `set_status`, `_adopt`): `tags` rows
  replaced (deleted, then inserted) and `runs.status`/`end_time` updated, for every run in a few statements;
* reading (`runs`, `metric_histories`, `artifact_locations`): `runs`, `tags`, `latest_metrics`, `metrics`.

Metrics are never written here: a job logs its own through MLflow's client (`logger.RunLogger`), and so do
artifacts where the store's are not on this machine. MLflow's API has no call that creates many runs, sets
many runs' status or deletes a tag of many runs: `create_run`, `log_batch`, `update_run` and `delete_tag` take
one run each. And `search_runs` returns each metric's latest value but not its step, which `status` shows,
so reading a sweep through it takes a `get_metric_history` per run and metric (what `ClientLedger` does on a
tracking server). Measured with `python bench/ledger.py` (512 runs on the embedded SQLite store, a 2-core
machine at a load of 6 to 9): registering them took 0.74 s in 10 statements here and 39.8 s in 2,048 calls
of MLflow's batch API (one call at a time: 16 at once, as `ClientLedger` makes them to a server, exhausted
MLflow's connection pool on SQLite, `QueuePool limit of size 5 overflow 10 reached`); reading them back as
`status` does, 0.04 s in 3 statements against 3.6 s in 1,025 calls. What the SQL here writes, MLflow reads as
its own: tests/test_mlflow_layout.py compares a run registered here with one made through MLflow's client.
"""

from __future__ import annotations

import contextlib
import getpass
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from pdmctl.ledger.base import Ledger
from pdmctl.ledger.records import (
    EXPERIMENT_TAGS,
    FINISHED,
    HTTP_TIMEOUT_S,
    PARENT_TAG,
    READ_TAGS,
    RUN_NAME_TAG,
    SCHEDULED,
    SPEC_ARTIFACT,
    STATUS_METRICS,
    TAG,
    TAG_ATTEMPT,
    TAG_JOB,
    TAG_LEDGER,
    TAG_REASON,
    TAG_SWEEP,
    TAG_SWEEP_RUN,
    TERMINAL,
    LedgerError,
    RunRecord,
    _record,
    _tags_for,
    flatten,
    ledger_state,
    ledger_tags,
    metric_value,
    run_dir_of,
    run_name,
    spec_artifact,
    submitting_commit,
    sweep_run_tags,
)
from pdmctl.ledger.store import (
    _ENGINES,
    _check_sqlite_file,
    _chunks,
    _file_lock,
    _holders,
    _lock_path,
    _mlflow_store,
    _mlflow_table_names,
    _now_ms,
    _sqlite_pragmas,
    busy_seconds,
    put_artifacts,
)
from pdmctl.ledger.uris import _connect_args, _first_line, _redact, check_reachable, sqlite_path

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
                    tags.c.run_uuid.in_(ids), tags.c.key.like(f"{TAG}%") | tags.c.key.in_(READ_TAGS)
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

    def artifact_locations(self, run_ids):
        runs = self.t["runs"]
        out = {}
        with self._usable(), self.engine.connect() as conn:
            for chunk in _chunks(list(run_ids), 500):
                query = self._sa.select(runs.c.run_uuid, runs.c.artifact_uri).where(runs.c.run_uuid.in_(chunk))
                out.update({rid: location for rid, location in conn.execute(query)})
                self.queries += 1
        return out

    # -- writing --------------------------------------------------------------------------

    def _create_runs(self, sweep, specs, run_dir, parent=None):
        with self._usable():
            created, locations = self._insert_runs(sweep, specs, run_dir, parent)
        by_key = {s.key: s for s in specs}
        try:  # the spec for people, beside the ledger's own copy (which alone the ledger reads)
            for key, run_id in created.items():
                put_artifacts(self.uri, run_id, locations[run_id],
                              [(SPEC_ARTIFACT, spec_artifact(by_key[key].to_json()))])  # fmt: skip
        except Exception as exc:  # an artifact store this machine cannot write: the runs stand without it
            print(f"pdmctl: {SPEC_ARTIFACT} not written into the new runs' artifacts ({_first_line(exc)[:200]})",
                  file=sys.stderr)  # fmt: skip
        return created

    def _run_row(self, run_id: str, name: str, sweep: str, exp_id: int, artifact_root: str, status: str,
                 now: int, commit: str | None) -> dict:  # fmt: skip
        return dict(run_uuid=run_id, name=name, source_type="JOB", source_name=f"pdmctl sweep {sweep}",
                    entry_point_name="", user_id=getpass.getuser(), status=status, start_time=now,
                    end_time=now if status in TERMINAL else None, source_version=commit or "",
                    lifecycle_stage="active", artifact_uri=f"{artifact_root.rstrip('/')}/{run_id}/artifacts",
                    experiment_id=exp_id, deleted_time=None)  # fmt: skip

    def _insert_runs(self, sweep, specs, run_dir, parent):
        exp_id, artifact_root = self._experiment(sweep)
        now = _now_ms()
        commit = submitting_commit()
        run_rows, tag_rows, param_rows, created = [], [], [], {}
        for spec in specs:
            run_id = uuid.uuid4().hex
            created[spec.key] = run_id
            run_rows.append(self._run_row(run_id, run_name(spec), spec.sweep, exp_id, artifact_root, SCHEDULED, now,
                                          commit))  # fmt: skip
            tag_rows += [
                dict(key=k, value=v, run_uuid=run_id)
                for k, v in _tags_for(spec, run_dir_of(run_dir[spec.key], run_id), commit, parent).items()
            ]
            param_rows += [dict(key=k, value=v, run_uuid=run_id) for k, v in flatten(spec.config).items()]
        self._insert(run_rows, tag_rows, param_rows)
        return created, {r["run_uuid"]: r["artifact_uri"] for r in run_rows}

    def _insert(self, run_rows: list[dict], tag_rows: list[dict], param_rows: list[dict]) -> None:
        run_cols = set(self.t["runs"].c.keys())
        with self.engine.begin() as conn:
            conn.execute(
                self.t["runs"].insert(), [{k: v for k, v in r.items() if k in run_cols} for r in run_rows]
            )
            conn.execute(self.t["tags"].insert(), tag_rows)
            if param_rows:
                conn.execute(self.t["params"].insert(), param_rows)
        self.queries += 3

    def sweep_run(self, sweep, create=False):
        sa, runs, tags, exps = self._sa, self.t["runs"], self.t["tags"], self.t["experiments"]
        query = (sa.select(runs.c.run_uuid).join(tags, tags.c.run_uuid == runs.c.run_uuid)
                 .join(exps, exps.c.experiment_id == runs.c.experiment_id)
                 .where(tags.c.key == TAG_SWEEP_RUN, tags.c.value == sweep, exps.c.name == sweep,
                        runs.c.lifecycle_stage == "active").order_by(runs.c.start_time).limit(1))  # fmt: skip
        with self._usable():
            with self.engine.connect() as conn:
                found = conn.execute(query).scalar()
            self.queries += 1
            if found is not None or not create:
                return found
            exp_id, artifact_root = self._experiment(sweep)
            run_id = uuid.uuid4().hex
            row = self._run_row(run_id, sweep_run_tags(sweep)[RUN_NAME_TAG], sweep, exp_id, artifact_root, FINISHED,
                                _now_ms(), None)  # fmt: skip
            self._insert([row], [dict(key=k, value=v, run_uuid=run_id) for k, v in sweep_run_tags(sweep).items()], [])
            return run_id

    def _adopt(self, parent, run_ids):
        if parent is None or not run_ids:
            return
        with self._usable(), self.engine.begin() as conn:
            self._replace_tags(conn, list(run_ids), [dict(key=PARENT_TAG, value=parent, run_uuid=r) for r in run_ids])

    def mark_submitted(self, submissions):
        if not submissions:
            return
        rows = []
        for s in submissions:
            rows += [dict(key=TAG_JOB, value=s.job_id, run_uuid=s.run_id),
                     dict(key=TAG_ATTEMPT, value=str(s.attempt), run_uuid=s.run_id)]  # fmt: skip
        ids = [s.run_id for s in submissions]
        with self._usable(), self.engine.begin() as conn:
            self._replace_tags(conn, ids, rows, cleared=(TAG_REASON,))
            self._update_status(conn, ids, SCHEDULED, end_time=None)

    def mark_intent(self, submissions, executor):
        if not submissions:
            return
        tags = self.t["tags"]
        ids = list(submissions)
        present: dict[str, dict[str, str]] = defaultdict(dict)
        with self._usable():
            with self.engine.connect() as conn:  # read apart from the write: the record has no other writer now
                for chunk in _chunks(ids, 500):
                    for run_id, key, value in conn.execute(self._sa.select(tags.c.run_uuid, tags.c.key, tags.c.value)
                                                           .where(tags.c.run_uuid.in_(chunk),
                                                                  tags.c.key.like(f"{TAG_LEDGER}%"))):  # fmt: skip
                        present[run_id][key] = value
            rows = []
            for run_id, submission in submissions.items():
                state = {**ledger_state(present[run_id]), "submission": submission, "executor": executor}
                rows += [dict(key=k, value=v, run_uuid=run_id) for k, v in ledger_tags(state).items()]
            stale = sorted({k for tags_of in present.values() for k in tags_of})
            with self.engine.begin() as conn:
                self._replace_tags(conn, ids, rows, cleared=tuple(stale))

    def _replace_tags(self, conn, run_ids: list[str], rows: list[dict[str, str]], cleared: tuple[str, ...] = ()
                      ) -> None:  # fmt: skip
        """Each run's tags named in `rows` (and `cleared`: a tag no longer true is removed, never left empty)."""
        tags = self.t["tags"]
        keys = sorted({r["key"] for r in rows} | set(cleared))
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
                    conn.execute(self.t["experiment_tags"].insert(),
                                 [dict(key=k, value=v, experiment_id=exp_id) for k, v in EXPERIMENT_TAGS.items()])  # fmt: skip
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

