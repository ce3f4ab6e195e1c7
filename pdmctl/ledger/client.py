"""`ClientLedger`: tracking servers (`http://`, `https://`) through `MlflowClient`, with a thread pool
where MLflow has no bulk call; a failed call is one line."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

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
    TAG_LOGIN,
    TAG_OWNER,
    TAG_REASON,
    TAG_SHARED,
    TAG_SWEEP,
    TAG_SWEEP_RUN,
    TERMINAL,
    LedgerError,
    Submission,
    SweepOwnerError,
    _record,
    _tags_for,
    flatten,
    ledger_state,
    ledger_tags,
    login_list,
    metric_value,
    run_dir_of,
    run_name,
    spec_artifact,
    stale_ledger_parts,
    submitting_commit,
    sweep_run_tags,
    tracking_login,
)
from pdmctl.ledger.store import _chunks, _mlflow_client
from pdmctl.ledger.uris import _first_line, _redact, check_reachable
from pdmctl.spec import RunSpec

QUICK_HTTP_ENV = "PDMCTL_QUICK_HTTP"  # the MLflow HTTP settings a pdmctl command set for itself, not the user


def quick_http_for_this_process() -> None:
    """No retries and a 5 s timeout for MLflow's HTTP calls in this process, where the user has not set
    them; what was set here is named in `QUICK_HTTP_ENV` so that the processes this one starts, which
    inherit its environment, can leave them out (`without_quick_http`)."""
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(HTTP_TIMEOUT_S))}
    ours = {name for name in os.environ.get(QUICK_HTTP_ENV, "").split(",") if name}
    for name, value in quick.items():
        if name not in os.environ:
            os.environ[name] = value
            ours.add(name)
    if ours:
        os.environ[QUICK_HTTP_ENV] = ",".join(sorted(ours))


def without_quick_http(env: dict[str, str]) -> dict[str, str]:
    """`env` without the MLflow HTTP settings a pdmctl command set for itself (`quick_http_for_this_process`):
    code that relies on MLflow's own retries (VeRL's tracking, which calls MLflow directly) gets MLflow's
    defaults, or what the user set. In CI, VeRL inherited a 5 s timeout and no retries from the `pdmctl
    sweep` that started its job, and a slow `log-batch` of its config made it train without MLflow."""
    ours = {name for name in env.get(QUICK_HTTP_ENV, "").split(",") if name}
    return {name: value for name, value in env.items() if name not in ours and name != QUICK_HTTP_ENV}


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
            said = _first_line(exc)
            if re.search(r"code 40[13]\b|Unauthorized|UNAUTHENTICATED|PERMISSION_DENIED", said):
                who = os.environ.get("MLFLOW_TRACKING_USERNAME")
                raise LedgerError(f"tracking server {_redact(self.uri)}: refused the login "
                                  + (f"of {who} (a wrong MLFLOW_TRACKING_PASSWORD, or no permission)" if who else
                                     "(none given): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
                                  + f" ({said[:200]})") from exc  # fmt: skip
            if re.search(r"ReadTimeout|Read timed out", str(exc)):
                waited = os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", f"{HTTP_TIMEOUT_S:g}")
                raise LedgerError(f"tracking server {_redact(self.uri)}: {method.__name__.strip('_')} got no answer "
                                  f"within {waited} s (a hung or overloaded server; a just-started one answers "
                                  "each worker's first call slowly): MLFLOW_HTTP_REQUEST_TIMEOUT=SECONDS waits "
                                  "longer") from exc  # fmt: skip
            raise LedgerError(f"tracking server {_redact(self.uri)}: {method.__name__.strip('_')} failed "
                              f"({said[:300]})") from exc  # fmt: skip

    return call


class ClientLedger(Ledger):
    def __init__(self, uri: str) -> None:
        check_reachable(uri, timeout=HTTP_TIMEOUT_S)
        # MLflow's own defaults retry a dead server for minutes (and a hung one for as long): a command
        # answers within seconds, its first failed call one line (`_server`)
        quick_http_for_this_process()
        self.uri = uri
        self.client = _mlflow_client(uri)
        self.queries = 0

    def _by_name(self, sweep: str):
        """The sweep's experiment (None if there is none); one that belongs to a login that gave this one no
        access (the server's default, NO_PERMISSIONS) is SweepOwnerError."""
        try:
            return self.client.get_experiment_by_name(sweep)
        except Exception as exc:
            denied = getattr(exc, "error_code", "") == "PERMISSION_DENIED" or re.search(r"code 403\b", str(exc))
            if not denied:
                raise
            login = tracking_login()
            raise SweepOwnerError(f"sweep {sweep!r} belongs to another login on {_redact(self.uri)}: {login} has "
                                  f"no access to it (choose another --name, or ask its owner to share it: pdmctl "
                                  f"server share {sweep} {login})") from None  # fmt: skip

    def _experiments(self, sweep: str | None) -> list:
        if sweep is not None:
            exp = self._by_name(sweep)
            return [exp] if exp else []
        return list(self.client.search_experiments(filter_string="tags.pdmctl = 'sweep'"))

    def _search(self, sweep: str | None):
        exps = self._experiments(sweep)
        if not exps:
            return [], {}
        filt = f"tags.`{TAG_SWEEP}` = '{sweep}'" if sweep else f"tags.`{TAG_SWEEP}` LIKE '%'"
        runs, token = [], None
        while True:
            page = self.client.search_runs([e.experiment_id for e in exps], filt, max_results=5000,
                                           page_token=token)  # fmt: skip
            self.queries += 1
            runs += list(page)
            token = page.token
            if not token:
                return runs, {e.experiment_id: e.tags for e in exps}

    @_server_call
    def owner_problem(self, sweep, write=True):
        login = tracking_login()
        if login is None:  # a server without logins: no owners
            return None
        try:
            exp = self._by_name(sweep)
        except SweepOwnerError as exc:
            return str(exc)
        return self._foreign(exp, sweep, login) if exp is not None and write else None

    def _foreign(self, exp, sweep: str, login: str | None) -> str | None:
        """Why `login` may not change the sweep of experiment `exp`, or None: it has no owner (created
        before pdmctl recorded one, or without a login), or `login` owns it or was shared it."""
        owner = exp.tags.get(TAG_OWNER)
        if not owner or not login or login == owner or login in login_list(exp.tags.get(TAG_SHARED)):
            return None
        return (f"sweep {sweep!r} belongs to login {owner} on {_redact(self.uri)}: {login} may not change it "
                f"(choose another --name, or ask {owner} to share it: pdmctl server share {sweep} {login})")

    @_server_call
    def runs(self, sweep=None):
        out = []
        found, sweep_tags = self._search(sweep)
        for run in found:
            tags = {k: v for k, v in run.data.tags.items() if k.startswith(TAG) or k in READ_TAGS}
            latest = {}
            for key in STATUS_METRICS:
                if key in run.data.metrics:
                    latest[key] = (self._latest_step(run, key), metric_value(run.data.metrics[key]))
            out.append(
                _record(
                    run.info.run_id, run.info.status, run.info.start_time, run.info.end_time, tags, latest,
                    sweep_tags.get(run.info.experiment_id),
                )
            )
        return out

    def _latest_step(self, run, key: str) -> int:
        hist = self.client.get_metric_history(run.info.run_id, key)
        self.queries += 1
        return max((m.step for m in hist), default=0)

    @_server_call
    def _create_runs(self, sweep, specs, run_dir, parent=None):
        from mlflow.entities import Param, RunTag

        exp_id = self._ensure_experiment(sweep)
        commit, login = submitting_commit(), tracking_login()

        def create(spec: RunSpec) -> tuple[str, str]:
            # the ledger's record names the run's directory, which is named by the run id: written once it is known
            tags = {k: v for k, v in _tags_for(spec, "", commit, parent).items() if not k.startswith(TAG_LEDGER)}
            if login:
                tags[TAG_LOGIN] = login
            run = self.client.create_run(exp_id, run_name=run_name(spec), tags=tags)
            record = {"spec": spec.to_json(), "run_dir": run_dir_of(run_dir[spec.key], run.info.run_id)}
            run_tags = [RunTag(k, v) for k, v in ledger_tags(record).items()]
            params = [Param(k, v) for k, v in flatten(spec.config).items()]
            for chunk in _chunks(params, 100):
                self.client.log_batch(run.info.run_id, params=chunk, tags=run_tags)
            self.client.log_text(run.info.run_id, spec_artifact(spec.to_json()), SPEC_ARTIFACT)
            self.client.update_run(run.info.run_id, status=SCHEDULED)
            return spec.key, run.info.run_id

        with ThreadPoolExecutor(16) as pool:
            return dict(pool.map(create, specs))

    @_server_call
    def sweep_run(self, sweep, create=False):
        from mlflow.entities import ViewType

        exp = self._by_name(sweep)
        if exp is not None and exp.lifecycle_stage == "active":
            found = self.client.search_runs([exp.experiment_id], f"tags.`{TAG_SWEEP_RUN}` = '{sweep}'",
                                            run_view_type=ViewType.ACTIVE_ONLY, max_results=1,
                                            order_by=["attributes.start_time ASC"])  # fmt: skip
            self.queries += 1
            if found:
                return found[0].info.run_id
        if not create:
            return None
        exp_id = self._ensure_experiment(sweep)
        tags = sweep_run_tags(sweep)
        run = self.client.create_run(exp_id, run_name=tags[RUN_NAME_TAG], tags=tags)
        self.client.set_terminated(run.info.run_id, status=FINISHED)
        return run.info.run_id

    @_server_call
    def _adopt(self, parent, run_ids):
        if parent is None or not run_ids:
            return
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda run_id: self.client.set_tag(run_id, PARENT_TAG, parent), run_ids))

    def _ensure_experiment(self, sweep: str) -> str:
        """The sweep's experiment id, created where there is none, owned by this login (`pdmctl.owner`; MLflow
        gives its creator MANAGE); one of another login's is SweepOwnerError, as one made meanwhile."""
        exp = self._by_name(sweep)
        if exp is None:
            login = tracking_login()
            owner = {TAG_OWNER: login} if login else {}
            try:
                return self.client.create_experiment(sweep, tags={**EXPERIMENT_TAGS, **owner})
            except Exception:
                exp = self._by_name(sweep)
                if exp is None:
                    raise
        if exp.lifecycle_stage != "active":
            raise LedgerError(f"sweep {sweep!r}: its MLflow experiment is deleted; restore or purge it first")
        problem = self._foreign(exp, sweep, tracking_login())
        if problem:
            raise SweepOwnerError(problem)
        return exp.experiment_id

    @_server_call
    def mark_submitted(self, submissions):
        from mlflow.entities import RunTag

        def mark(s: Submission) -> None:
            self.client.log_batch(s.run_id, tags=[RunTag(TAG_JOB, s.job_id), RunTag(TAG_ATTEMPT, str(s.attempt))])
            if TAG_REASON in self.client.get_run(s.run_id).data.tags:  # a tag no longer true is removed, never left empty
                self.client.delete_tag(s.run_id, TAG_REASON)
            self.client.update_run(s.run_id, status=SCHEDULED)

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(mark, submissions))

    @_server_call
    def mark_intent(self, submissions, executor):
        from mlflow.entities import RunTag

        login = tracking_login()

        def mark(item: tuple[str, str]) -> None:
            run_id, submission = item
            present = self.client.get_run(run_id).data.tags
            state = {**ledger_state(present), "submission": submission, "executor": executor}
            tags = [RunTag(k, v) for k, v in ledger_tags(state).items()]
            if login:  # who submits this attempt ("token:index:attempt"): its job writes under this login
                tags.append(RunTag(f"{TAG_LOGIN}.{submission.rpartition(':')[2]}", login))
            self.client.log_batch(run_id, tags=tags)
            for key in stale_ledger_parts(present, state):
                self.client.delete_tag(run_id, key)

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
    def artifact_locations(self, run_ids):
        with ThreadPoolExecutor(16) as pool:
            found = list(pool.map(lambda rid: (rid, self.client.get_run(rid).info.artifact_uri), run_ids))
        self.queries += len(run_ids)
        return dict(found)

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

