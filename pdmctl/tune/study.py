"""The tune driver: an Optuna study whose trials are ordinary pdmctl runs.

A trial's parameters become overrides, the overrides a RunSpec (one per seed),
and the spec goes through the same `orchestrate.sweep` as any grid: the study's
name is the sweep's, so `pdmctl status/logs/resume/cancel NAME` see the trials'
runs. The driver keeps no state of its own. Each pass reads the study (Optuna's
RDB storage) and the ledger, and:

* tells Optuna about trials whose runs ended: the objective of finished runs,
  PRUNED for runs their job pruned, FAIL for runs that failed `max_attempts`
  times (fewer: `orchestrate.resume` brings them back from their checkpoints);
* submits the runs of trials that have none (a driver killed between `ask` and
  the submission leaves such a trial; the next pass submits it);
* asks new trials while fewer than `parallel` are in flight and the study has
  fewer than `trials`. A trial whose config is a run the study already has (a
  sampler proposing a config twice) waits for that run or takes its result:
  the ledger's key, not the trial, decides what trains.

Killing the driver at any point loses nothing: every fact lives in the storage
or the ledger, and the next `pdmctl tune` (the same command) continues.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pdmctl import orchestrate
from pdmctl.backends.registry import flat_config, get_backend
from pdmctl.grid import check_sweep_name
from pdmctl.ledger import _redact, is_database_uri, ledger_exists, open_ledger, sqlite_path, uri_lock
from pdmctl.orchestrate import Context, RunState, RunView
from pdmctl.spec import RunSpec
from pdmctl.tune.space import SearchSpace, hydra_session, parse_space
from pdmctl.tune.trial import OPTUNA_SCHEMA, PRUNERS, TrialLink, make_pruner, open_storage

SAMPLERS = ("tpe", "cmaes", "random", "grid")
DIRECTIONS = ("maximize", "minimize")
AT = ("final", "best")
AVG16 = "avg@16"  # the mean of the run config's held-out sets (data.eval): AIME24/25, the testbed's toy24/25
# what every backend logs besides eval/<set> (pdmctl.backends.base)
TRAIN_METRICS = ("train/reward", "train/response_length", "train/ppo_kl", "train/mask_frac",
                 "train/out_of_region_frac", "train/mean_divergence", "train/disagreement_count")  # fmt: skip
ATTR = "pdmctl.tune"  # study user attribute: the request that defines the study
KEYS_ATTR = "pdmctl.keys"  # trial user attribute: its runs' keys
ABANDONED_ATTR = "pdmctl.abandoned"  # a trial whose `ask` a killed driver left half-stored; not counted


class TuneError(ValueError):
    """A study that cannot be run as asked; the message is one line."""


@dataclass(frozen=True)
class Request:
    """What defines a study: a second `pdmctl tune NAME` must ask the same to continue it."""

    overrides: tuple[str, ...]
    objective: str = AVG16
    direction: str = "maximize"
    at: str = "final"
    pruner: str = "median"
    seeds_per_trial: int = 1

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Request:
        data = json.loads(text)
        return cls(**{**data, "overrides": tuple(data["overrides"])})


@dataclass(frozen=True)
class Options:
    """How this invocation drives the study (free to change between invocations)."""

    trials: int
    parallel: int = 1
    sampler: str = "tpe"
    seed: int | None = None
    max_attempts: int = 2
    poll_s: float = 1.0


@dataclass(frozen=True)
class Plan:
    """A validated request: the space, the objective's metrics, where the study lives."""

    name: str
    request: Request
    space: SearchSpace
    metrics: tuple[str, ...]  # the objective is their mean at an evaluation point
    storage: str


def check(name: str, request: Request, options: Options | None, ctx: Context, storage: str | None) -> Plan:
    """Everything that can refuse the study, before anything is written (TuneError/GridError/SpecError)."""
    check_sweep_name(name)
    for what, value, allowed in (("--direction", request.direction, DIRECTIONS), ("--at", request.at, AT),
                                 ("--pruner", request.pruner, PRUNERS)):  # fmt: skip
        if value not in allowed:
            raise TuneError(f"{what}: unknown {value!r}; choose from {', '.join(allowed)}")
    if request.seeds_per_trial < 1:
        raise TuneError(f"--seeds-per-trial: must be >= 1, got {request.seeds_per_trial}")
    if any(o.split("=", 1)[0].lstrip("+~") in ("seed", "seeds") for o in request.overrides):
        raise TuneError("seed: set by the study (--seeds-per-trial), not an override")
    space = parse_space(request.overrides)
    with hydra_session():
        config = space.specs(name, _first_values(space), 1)[0].config
    metrics = objective_metrics(request.objective, config)
    if options is not None:
        if options.trials < 1:
            raise TuneError(f"--trials: must be >= 1, got {options.trials}")
        if options.parallel < 1:
            raise TuneError(f"--parallel: must be >= 1, got {options.parallel}")
        if options.max_attempts < 1:
            raise TuneError(f"--max-attempts: must be >= 1, got {options.max_attempts}")
        make_sampler(options.sampler, options.seed, space)
    url = storage_url(ctx.tracking_uri, storage)
    check_sqlite_storage(url, ctx.tracking_uri)
    check_storage_reachable(url)
    return Plan(name, request, space, metrics, url)


def objective_metrics(objective: str, config: dict[str, Any]) -> tuple[str, ...]:
    evals = tuple(f"eval/{s}" for s in (config.get("data") or {}).get("eval") or ())
    if objective == AVG16:
        if not evals:
            raise TuneError(f"--objective {AVG16}: the run config names no held-out sets (data.eval)")
        return evals
    if objective not in (*evals, *TRAIN_METRICS):
        raise TuneError(f"--objective: {objective!r} is not a metric the {config['backend']['name']} backend "
                        f"logs; choose from {', '.join((AVG16, *evals, *TRAIN_METRICS))}")  # fmt: skip
    return (objective,)


def make_sampler(name: str, seed: int | None, space: SearchSpace):
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, constant_liar=True)  # in-flight trials count as lies
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "cmaes":
        try:
            import cmaes  # noqa: F401  (Optuna's CmaEsSampler needs it)
        except ImportError:
            raise TuneError("--sampler cmaes: needs the cmaes package (pip install cmaes)") from None
        return optuna.samplers.CmaEsSampler(seed=seed)
    if name == "grid":
        grid = {}
        for p in space.params:
            if not hasattr(p.distribution, "choices"):
                raise TuneError(
                    f"--sampler grid: {p.name} is a range; the grid sampler takes choice(...) only"
                )
            grid[p.name] = list(p.distribution.choices)
        return optuna.samplers.GridSampler(grid, seed=seed)
    raise TuneError(f"--sampler: unknown {name!r}; choose from {', '.join(SAMPLERS)}")


def storage_url(tracking_uri: str, given: str | None) -> str:
    """Beside the ledger: a sibling SQLite file, or the ledger's own PostgreSQL database (schema of its own).

    Not the ledger's SQLite file itself: MLflow and Optuna both keep their schema
    version in alembic's one `alembic_version` table, and each refuses the other's.
    """
    given = given if given is not None else os.environ.get("PDMCTL_TUNE_STORAGE")
    if given is not None and not given.strip():
        raise TuneError("--storage: empty (an unset variable?); give a URL, or leave it out for the default")
    if given:
        return check_storage(given)
    path = sqlite_path(tracking_uri)
    if path is not None:
        return f"sqlite:///{path.with_name(path.stem + '.optuna' + path.suffix)}"
    if tracking_uri.startswith("postgresql"):
        return tracking_uri
    kind = "an MLflow server" if not is_database_uri(tracking_uri) else "a database Optuna cannot share"
    raise TuneError(
        f"tune: the ledger {tracking_uri} is {kind}; pass --storage (sqlite:///... or postgresql://...)"
    )


def check_storage(url: str) -> str:
    """An Optuna RDB storage URL that SQLAlchemy can open (its dialect and driver installed); TuneError
    (one line) otherwise. Looks at the text and the installed modules only: nothing is connected to."""
    import sqlalchemy

    try:
        parsed = sqlalchemy.engine.make_url(url)
        parsed.get_dialect()  # the dialect, and with it the driver's module
    except sqlalchemy.exc.NoSuchModuleError:
        raise TuneError(f"--storage {_redact(url)}: unsupported database {url.split(':', 1)[0]!r} "
                        "(use sqlite:///PATH or postgresql://...)") from None  # fmt: skip
    except sqlalchemy.exc.ArgumentError:
        raise TuneError(f"--storage {_redact(url)}: not a database URL (sqlite:///PATH or postgresql://...)") from None
    except ImportError as exc:
        raise TuneError(f"--storage {_redact(url)}: its database driver {exc.name or exc} is not installed") from None
    try:
        parsed.get_dialect().import_dbapi()  # the driver itself (make_url finds the dialect only)
    except ImportError as exc:
        hint = "; name one that is, e.g. postgresql+psycopg2://" if url.startswith("postgresql") else ""
        raise TuneError(f"--storage {_redact(url)}: its database driver {exc.name or exc} is not installed{hint}") from None
    if parsed.get_backend_name() == "sqlite":
        database = (parsed.database or "").strip("/")
        if not database or database == ":memory:" or database.startswith("file::memory:"):
            raise TuneError(f"--storage {url}: a SQLite storage is sqlite:///PATH (a file, not memory: the jobs "
                            "report their trials to it from other processes)")  # fmt: skip
        if parsed.query or "?" in url:
            raise TuneError(f"--storage {url}: a SQLite storage is sqlite:///PATH, without ?options (the study "
                            "is written to: not read-only, not in memory)")  # fmt: skip
    return url


def check_storage_reachable(url: str, timeout: float = 5.0) -> None:
    """A database server's storage answers (TuneError, one line, when it does not): checked before any run
    is registered, in a dry run too. SQLite files are checked by check_sqlite_storage."""
    if sqlite_path(url) is not None:
        return
    import sqlalchemy

    connect_args = {"connect_timeout": int(timeout)} if url.startswith(("postgresql", "mysql")) else {}
    try:
        engine = sqlalchemy.create_engine(url, connect_args=connect_args)
        try:
            with engine.connect() as conn:
                conn.execute(sqlalchemy.text("SELECT 1"))
        finally:
            engine.dispose()
    except Exception as exc:  # the driver's OperationalError, a refused login, a name that does not resolve
        why = " ".join(str(exc).split("\n")[0].split())[:200]
        raise TuneError(f"study storage {_redact(url)}: cannot connect ({why})") from None


_SQLITE_MAGIC = b"SQLite format 3\x00"


def check_sqlite_storage(url: str, tracking_uri: str) -> None:
    """A SQLite study storage Optuna can create or open, refused (TuneError, one line) before anything is
    written: its directory exists, it is not the ledger itself (MLflow and Optuna each keep their schema
    version in alembic's one `alembic_version` table), and a file already there is a SQLite database whose
    tables are Optuna's (or none yet) and that this process can write."""
    import sqlite3

    path = sqlite_path(url)
    if path is None:
        return
    where = f"study storage {url}"
    ledger = sqlite_path(tracking_uri)
    try:
        if ledger is not None and path.resolve() == ledger.resolve():
            raise TuneError(f"{where}: is the ledger itself; Optuna's tables need a database of their own "
                            f"(the default: {ledger.with_name(ledger.stem + '.optuna' + ledger.suffix)})")  # fmt: skip
        if not path.parent.is_dir():
            raise TuneError(f"{where}: directory {path.parent} does not exist")
        if not path.exists():
            if not os.access(path.parent, os.W_OK | os.X_OK):
                raise TuneError(f"{where}: directory {path.parent} is not writable")
            return
        if not path.is_file():
            raise TuneError(f"{where}: {path} is not a file")
        with open(path, "rb") as fh:
            magic = fh.read(len(_SQLITE_MAGIC))
        if magic and magic != _SQLITE_MAGIC:
            raise TuneError(f"{where}: {path} is not a SQLite database (move it away, or name another file)")
        if not os.access(path, os.W_OK):
            raise TuneError(f"{where}: {path} is not writable")
        if not magic:
            return  # an empty file: SQLite makes it a database
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
        try:
            tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise TuneError(f"{where}: {path} is not a usable SQLite database ({exc})") from None
    except OSError as exc:
        raise TuneError(f"{where}: {exc.strerror or exc}") from None
    if tables and "studies" not in tables:
        raise TuneError(f"{where}: {path} holds other tables than Optuna's ({', '.join(sorted(tables)[:3])}, ...); "
                        "name a file of its own")  # fmt: skip


def _first_values(space: SearchSpace) -> dict[str, Any]:
    out = {}
    for p in space.params:
        d = p.distribution
        out[p.name] = d.choices[0] if hasattr(d, "choices") else d.low
    return out


# ---------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------


def _counted(trials: list) -> list:
    """The trials that count against `--trials` (all but those a killed `ask` left half-stored)."""
    return [t for t in trials if ABANDONED_ATTR not in t.user_attrs]


@dataclass
class Pass:
    """What one pass of the driver saw and did."""

    states: Counter = field(default_factory=Counter)  # Optuna trial state -> count, after the pass
    in_flight: int = 0
    asked: int = 0
    told: int = 0

    @property
    def total(self) -> int:
        return sum(self.states.values())


@dataclass(frozen=True)
class _Outcome:
    kind: str  # "submit" (specs to register and submit), "flight", "resume", "done"
    specs: tuple[RunSpec, ...] = ()


class Driver:
    def __init__(self, plan: Plan, options: Options, ctx: Context) -> None:
        self.plan, self.options, self.ctx = plan, options, ctx
        self.study: Any = None
        self._specs: dict[int, list[RunSpec]] = {}
        self.executor = orchestrate.check_before_submit(ctx)  # before open_ledger creates the store
        self.ledger = open_ledger(ctx.tracking_uri)
        self.seconds = 0.0  # the driver's own time in passes, wall clock (excludes waiting between them)
        self.cpu_seconds = 0.0  # the same, CPU time of this process (what a loaded machine does not inflate)

    def open(self) -> None:
        self.study = open_study(self.plan, self.options)
        if self.options.seed is not None:  # a continued study must not replay the first invocation's draws
            done = len(self.study.get_trials(deepcopy=False))
            self.study.sampler = make_sampler(self.options.sampler, self.options.seed + done, self.plan.space)
        stored = self.study.user_attrs.get(ATTR)
        if stored is None:
            self.study.set_user_attr(ATTR, self.plan.request.to_json())
        elif Request.from_json(stored) != self.plan.request:
            raise TuneError(f"study {self.plan.name!r}: exists with another {_difference(Request.from_json(stored), self.plan.request)}; "
                            "use another --name to start a new study")  # fmt: skip

    def specs_of(self, trial) -> list[RunSpec]:
        if trial.number not in self._specs:
            self._specs[trial.number] = self.plan.space.specs(
                self.plan.name, trial.params, self.plan.request.seeds_per_trial
            )
        return self._specs[trial.number]

    def _record_keys(self, trial) -> None:
        """The trial's run keys beside its parameters: status and the report read them there."""
        trial.set_user_attr(KEYS_ATTR, [s.key for s in self.specs_of(trial)])

    def step(self) -> Pass:
        """One pass: tell what ended, (re)submit what is missing, ask while there is room."""
        import optuna

        started, cpu_started = time.perf_counter(), time.process_time()
        result = Pass()
        views = self._views()
        trials = self.study.get_trials(deepcopy=False)
        submit: dict[str, tuple[RunSpec, int, bool]] = {}  # key -> (spec, its trial's id, reports to it)
        resume = False

        def settle(trial) -> None:
            nonlocal resume
            outcome = self._outcome(trial, views, submit)
            if outcome.kind == "done":
                result.told += 1
                return
            result.in_flight += 1
            resume |= outcome.kind == "resume"
            first = self.specs_of(trial)[0].key
            for spec in outcome.specs:
                submit[spec.key] = (spec, trial._trial_id, spec.key == first)

        abandoned = 0
        for trial in trials:
            if trial.state == optuna.trial.TrialState.RUNNING:
                if KEYS_ATTR not in trial.user_attrs:  # a driver killed right after its `ask`
                    if set(trial.params) != set(self.plan.space.distributions):
                        # killed inside `ask`, before all its parameters were stored: nothing ran
                        # for it (keys are recorded before any submission); it is failed and asked anew
                        optuna.trial.Trial(self.study, trial._trial_id).set_user_attr(ABANDONED_ATTR, True)
                        self.study.tell(trial.number, state=optuna.trial.TrialState.FAIL,
                                        skip_if_finished=True)  # fmt: skip
                        abandoned += 1
                        continue
                    self._record_keys(optuna.trial.Trial(self.study, trial._trial_id))
                settle(trial)
        total = len(_counted(trials)) - abandoned
        while result.in_flight < self.options.parallel and total < self.options.trials:
            trial = self.study.ask(self.plan.space.distributions)
            self._record_keys(trial)
            result.asked += 1
            total += 1
            settle(trial)
        if submit:
            links = {spec.key: TrialLink(self.plan.storage, self.plan.name, trial_id, self.plan.metrics,
                                         self.plan.request.pruner, reports, _final_step(spec))
                     for spec, trial_id, reports in submit.values()}  # fmt: skip
            self._submit([s for s, *_ in submit.values()], links)
        if resume:
            orchestrate.resume(self.ctx, self.plan.name, max_attempts=self.options.max_attempts)
        if result.asked or result.told or abandoned:
            trials = self.study.get_trials(deepcopy=False)
        result.states = Counter(t.state.name for t in _counted(trials))
        self.seconds += time.perf_counter() - started
        self.cpu_seconds += time.process_time() - cpu_started
        return result

    def _views(self) -> dict[str, RunView]:
        """The study's runs as `pdmctl status` sees them (the executor's word written into the ledger)."""
        records = self.ledger.runs(self.plan.name)
        if not records:
            return {}
        return {r.key: RunView(r.key, r.sweep, r.summary, orchestrate.run_state(r, js), r, js)
                for r, js in orchestrate.reconcile(self.ledger, records, self.ctx)}  # fmt: skip

    def _submit(self, specs: list[RunSpec], links: dict[str, TrialLink]) -> None:
        """Register the runs, give each run directory its trial link (the directory is named by the MLflow
        run id, known once registered), and submit those no job serves: `orchestrate.sweep`'s steps."""
        with self.ledger.lock():
            self.ledger.register(specs, {s.key: str(self.ctx.run_dir_parent(s)) for s in specs})
            by_key = {r.key: r for r in self.ledger.runs(self.plan.name)}
            for spec in specs:
                links[spec.key].write(self.ctx.run_dir(by_key[spec.key]))
            records = [by_key[s.key] for s in specs if not by_key[s.key].job_id]
            orchestrate._submit(records, self.ledger, self.executor, self.ctx)

    def _outcome(self, trial, views: dict[str, RunView], planned: dict[str, Any]) -> _Outcome:
        import optuna

        specs = self.specs_of(trial)
        found = [views.get(s.key) for s in specs]
        missing = tuple(s for s, v in zip(specs, found, strict=True)
                        if (v is None or v.state == RunState.UNSUBMITTED) and s.key not in planned)  # fmt: skip
        if missing or any(s.key in planned for s in specs):
            return _Outcome("submit", missing)
        states = [v.state for v in found if v is not None]
        if all(s == RunState.FINISHED for s in states):
            value = self._value([v.record.run_id for v in found if v and v.record])
            if value is None:
                self.study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            else:
                self.study.tell(trial.number, value, skip_if_finished=True)
            return _Outcome("done")
        if {RunState.PRUNED, RunState.STOPPED} & set(states):  # a collapse rule's ending counts as pruned
            self.study.tell(trial.number, state=optuna.trial.TrialState.PRUNED, skip_if_finished=True)
            return _Outcome("done")
        ended = [v for v in found if v and v.state in orchestrate.RESUMABLE]
        if any(v.record and v.record.attempt >= self.options.max_attempts for v in ended):
            self.study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            return _Outcome("done")
        return _Outcome("resume" if ended else "flight")

    def _value(self, run_ids: Sequence[str]) -> float | None:
        """The trial's objective: each run's at the final (or best) evaluation, averaged over seeds."""
        histories = self.ledger.metric_histories(list(run_ids), keys=list(self.plan.metrics))
        values = [run_objective(h, self.plan.metrics, self.plan.request.at, self.plan.request.direction)
                  for h in histories.values()]  # fmt: skip
        if not values or any(v is None for v in values):
            return None
        return sum(values) / len(values)  # type: ignore[arg-type]

    def run(self, wait: bool, on_pass: Callable[[Pass], None] | None = None) -> Pass:
        """Passes until the study has its trials and none is in flight (one pass unless `wait`)."""
        with self.lock(), hydra_session():
            while True:
                result = self.step()
                if on_pass is not None:
                    on_pass(result)
                if not wait or (result.in_flight == 0 and result.total >= self.options.trials):
                    return result
                time.sleep(self.options.poll_s)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One driver per study: a second `pdmctl tune NAME` is refused while one runs."""
        path = self.ctx.run_root / self.plan.name / ".tune.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise TuneError(f"study {self.plan.name!r}: another pdmctl tune is driving it now") from None
            yield


def _final_step(spec: RunSpec) -> int | None:
    return get_backend(spec.backend).final_step(flat_config(spec.config))


def run_objective(history: dict[str, list[tuple[int, float]]], metrics: Sequence[str], at: str,
                  direction: str) -> float | None:  # fmt: skip
    """One run's objective: the mean of `metrics` at each step where all are logged; final or best."""
    by_step: dict[int, dict[str, float]] = {}
    for name in metrics:
        for step, value in history.get(name, []):
            by_step.setdefault(step, {})[name] = value
    series = [
        (s, sum(v.values()) / len(metrics)) for s, v in sorted(by_step.items()) if len(v) == len(metrics)
    ]
    if not series:
        return None
    if at == "final":
        return series[-1][1]
    return (max if direction == "maximize" else min)(v for _, v in series)


def open_study(plan: Plan, options: Options):
    """The study, created with its storage's schema where new (TuneError, one line, where it cannot be)."""
    import optuna
    import sqlalchemy

    try:
        # one process at a time creates the storage's schema and the study: two drivers started together on
        # a new storage would both insert alembic's version row (UNIQUE constraint failed: alembic_version)
        with uri_lock(plan.storage):
            return optuna.create_study(
                study_name=plan.name,
                storage=create_storage(plan.storage),
                sampler=make_sampler(options.sampler, options.seed, plan.space),
                pruner=make_pruner(plan.request.pruner),
                direction=plan.request.direction,
                load_if_exists=True,
            )
    except (sqlalchemy.exc.SQLAlchemyError, RuntimeError) as exc:  # a server that refuses; a schema Optuna
        why = " ".join(str(exc).split("\n")[0].split())[:200]  # cannot read (RuntimeError)
        raise TuneError(f"study storage {_redact(plan.storage)}: cannot be opened ({why})") from None


def create_storage(url: str):
    """Open (and on PostgreSQL first give Optuna its schema) the study storage."""
    if url.startswith("postgresql"):
        import sqlalchemy

        engine = sqlalchemy.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text(f"CREATE SCHEMA IF NOT EXISTS {OPTUNA_SCHEMA}"))
        engine.dispose()
    return open_storage(url)


def _difference(old: Request, new: Request) -> str:
    for name in ("overrides", "objective", "direction", "at", "pruner", "seeds_per_trial"):
        a, b = getattr(old, name), getattr(new, name)
        if a != b:
            shown = (lambda v: " ".join(v)) if name == "overrides" else str
            return f"{name} ({shown(a)!s} there, {shown(b)!s} here)"
    return "definition"


# ---------------------------------------------------------------------------
# Reading a study
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TrialView:
    number: int
    state: str  # Optuna's, lower case; a running trial's run state beside it
    value: float | None
    params: dict[str, Any]
    keys: tuple[str, ...]
    run_state: str | None  # the runs' state in the ledger (for a running trial)


@dataclass(frozen=True)
class StudyView:
    name: str
    request: Request | None
    direction: str
    trials: list[TrialView]
    best: TrialView | None

    def counts(self) -> Counter:
        return Counter(t.state for t in self.trials)


def load_study(name: str, storage: str):
    import optuna

    try:
        return optuna.load_study(study_name=name, storage=open_storage(storage))
    except KeyError:
        raise TuneError(f"study {name!r}: not in {storage}") from None


def study_names(storage: str) -> list[str]:
    import optuna

    return sorted(s.study_name for s in optuna.get_all_study_summaries(open_storage(storage)))


def storage_exists(url: str) -> bool:
    path = sqlite_path(url)
    return path is None or path.exists()


def study_view(name: str, storage: str, ctx: Context) -> StudyView:
    """The study as `tune status` shows it: Optuna's word, read; the runs' states as `pdmctl status` finds them."""
    study = load_study(name, storage)
    views: dict[str, RunView] = {}
    if ledger_exists(ctx.tracking_uri):
        views = {v.key: v for v in orchestrate.status(ctx, name)}
    trials = []
    for t in _counted(study.get_trials(deepcopy=False)):
        keys = tuple(t.user_attrs.get(KEYS_ATTR, ()))
        run_states = sorted({str(views[k].state) for k in keys if k in views})
        trials.append(TrialView(t.number, t.state.name.lower(), t.value, dict(t.params), keys,
                                ", ".join(run_states) or None))  # fmt: skip
    complete = [t for t in trials if t.state == "complete" and t.value is not None]
    pick = max if study.direction.name == "MAXIMIZE" else min
    best = pick(complete, key=lambda t: t.value) if complete else None  # type: ignore[arg-type,return-value]
    stored = study.user_attrs.get(ATTR)
    return StudyView(
        name, Request.from_json(stored) if stored else None, study.direction.name.lower(), trials, best
    )
