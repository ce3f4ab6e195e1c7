"""What the ledger holds: its tags and statuses, a run's record, and the spec and config as MLflow
tags and params."""

from __future__ import annotations

import getpass
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdmctl.spec import RunSpec

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
# provenance (pdmctl.provenance): `pdmctl.prov.<field>` the latest attempt's, `pdmctl.prov.attempt.<n>` each
# attempt's job id, start and code (JSON)
TAG_PROVENANCE = "pdmctl.prov."
RUN_NAME_TAG = "mlflow.runName"
USER_TAG = "mlflow.user"
# MLflow's own tags, which its UI shows: the run's Source (a pdmctl sweep), the commit it was submitted
# from (a job replaces it with the commit it ran), and its Description (the run's one-line summary)
SOURCE_NAME_TAG, SOURCE_TYPE_TAG = "mlflow.source.name", "mlflow.source.type"
COMMIT_TAG, NOTE_TAG = "mlflow.source.git.commit", "mlflow.note.content"
# the experiment's kind in MLflow 3: a sweep opens in the training (custom model) view, not the GenAI one
EXPERIMENT_KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
EXPERIMENT_TAGS = {"pdmctl": "sweep", EXPERIMENT_KIND_TAG: TRAINING_KIND}
# MLflow tags the ledger reads back beside its own pdmctl.* ones
READ_TAGS = (NOTE_TAG,)
# on a tracking server with logins a sweep belongs to the login that created its experiment (`pdmctl.owner`),
# which may share it (`pdmctl.shared_with`: a JSON list of the logins that may also write it); a run records
# the login that registered it (`pdmctl.login`) and the one that submitted each attempt (`pdmctl.login.N`)
TAG_OWNER, TAG_SHARED, TAG_LOGIN = "pdmctl.owner", "pdmctl.shared_with", "pdmctl.login"
LOGIN_ENV = "MLFLOW_TRACKING_USERNAME"
AVG16_METRIC = "avg16"  # avg@16 (MLflow allows no "@"): the mean of the held-out sets at an evaluation, in %

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


class SweepOwnerError(LedgerError):
    """A sweep that belongs to another login: this login may not change it (one line)."""


def tracking_login() -> str | None:
    """The login MLflow's client sends (MLFLOW_TRACKING_USERNAME), if any."""
    return os.environ.get(LOGIN_ENV, "").strip() or None


def login_list(text: str | None) -> tuple[str, ...]:
    """The logins of a JSON list tag (`pdmctl.shared_with`); none where it is absent or not such a list."""
    try:
        value = json.loads(text or "[]")
    except ValueError:
        return ()
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


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
    provenance: dict[str, str] = field(default_factory=dict)  # pdmctl.prov.* tags without the prefix
    owner: str | None = None  # the login its sweep belongs to (a tracking server with logins)
    shared_with: tuple[str, ...] = ()  # the logins its owner let write the sweep too
    logins: tuple[str, ...] = ()  # the logins that registered the run and submitted its attempts

    @property
    def others(self) -> tuple[str, ...]:
        """The logins other than its sweep's owner that registered the run or submitted an attempt."""
        return tuple(name for name in self.logins if self.owner and name != self.owner)

    def writable_by(self, login: str | None) -> bool:
        """Whether `login` may change the run: its sweep has no owner, or `login` owns it or was shared it."""
        return not self.owner or not login or login == self.owner or login in self.shared_with

    @property
    def attempts(self) -> list[dict[str, Any]]:
        """Each recorded attempt (job id, executor, start, commit, ...), in attempt order."""
        out = []
        for name, value in self.provenance.items():
            if name.startswith("attempt."):
                try:
                    out.append({"attempt": int(name.removeprefix("attempt.")), **json.loads(value)})
                except (ValueError, TypeError):
                    continue
        return sorted(out, key=lambda a: a["attempt"])

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



def run_dir_of(parent: str, run_id: str) -> str:
    return str(Path(parent) / run_id)


def run_name(spec: RunSpec) -> str:
    """What MLflow's run table shows, the part that varies within a sweep first (its column shows about 19
    characters): `s0 pdm_agg δ0.05 K10 · bf16 toy-small`, the seed first as the shortest."""
    c = spec.config
    delta = "" if c["mask"].get("method") == "grpo" else f" δ{c['delta']:g}"
    return f"s{c['seed']} {c['mask']['name']}{delta} K{c['k']} · {c['precision']['name']} {c['model']['name']}"


def _tags_for(spec: RunSpec, run_dir: str, commit: str | None = None) -> dict[str, str]:
    """A new run's tags: MLflow's (name, user, source, commit, description) and pdmctl's, none empty."""
    tags = {
        RUN_NAME_TAG: run_name(spec),
        USER_TAG: getpass.getuser(),
        SOURCE_NAME_TAG: f"pdmctl sweep {spec.sweep}",
        SOURCE_TYPE_TAG: "JOB",
        NOTE_TAG: spec.summary[:_TAG_VALUE_MAX],
        TAG_SWEEP: spec.sweep,
        TAG_KEY: spec.key,
        TAG_BACKEND: spec.backend,
        TAG_ATTEMPT: "0",
        **spec_tags(spec.to_json()),
        TAG_RUN_DIR: run_dir,
    }
    if commit and commit != "unknown":
        tags[COMMIT_TAG] = commit
    return {k: v for k, v in tags.items() if v}


def submitting_commit() -> str | None:
    """The commit of the pdmctl checkout that registers the runs (None outside a git checkout)."""
    from pdmctl.provenance import git_state

    commit = git_state()["commit"]
    return None if commit == "unknown" else commit


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
            latest: dict[str, tuple[int, float]],
            sweep_tags: Mapping[str, str] | None = None) -> RunRecord:  # fmt: skip
    """A run's record; `sweep_tags`, its experiment's tags, say whose sweep it is (a tracking server's)."""
    attempts = sorted((int(k.rpartition(".")[2]), v) for k, v in tags.items()
                      if k.startswith(f"{TAG_LOGIN}.") and k.rpartition(".")[2].isdigit())  # fmt: skip
    logins = tuple(dict.fromkeys(v for v in (tags.get(TAG_LOGIN), *(v for _, v in attempts)) if v))
    return RunRecord(
        run_id=run_id,
        sweep=tags.get(TAG_SWEEP, ""),
        key=tags.get(TAG_KEY, ""),
        status=status,
        attempt=int(tags.get(TAG_ATTEMPT) or 0),
        job_id=tags.get(TAG_JOB) or None,
        executor=tags.get(TAG_EXECUTOR) or None,
        spec_json=_spec_json(tags),
        summary=tags.get(TAG_SUMMARY) or tags.get(NOTE_TAG, ""),  # pdmctl.summary: ledgers before the note
        run_dir=tags.get(TAG_RUN_DIR),
        reason=tags.get(TAG_REASON) or None,
        start_time=start,
        end_time=end,
        latest=latest,
        submission=tags.get(TAG_SUBMISSION) or None,
        submitted=tags.get(TAG_SUBMITTED) or None,
        notice=tags.get(TAG_NOTICE) or None,
        provenance={k.removeprefix(TAG_PROVENANCE): v for k, v in tags.items() if k.startswith(TAG_PROVENANCE)},
        owner=(sweep_tags or {}).get(TAG_OWNER) or None,
        shared_with=login_list((sweep_tags or {}).get(TAG_SHARED)),
        logins=logins,
    )


def login_notes(records: Sequence[RunRecord], login: str | None) -> list[str]:
    """The lines under `status` and `report` on whose sweeps they show: per sweep that has an owner, that it
    belongs to another login than `login` (the one reading), and its runs that a login other than the owner
    registered or submitted (their numbers were written under that login).

    What this sees: the logins pdmctl records when it registers a run and submits an attempt (a job writes its
    metrics under its submitter's login). What it cannot see: metrics, tags or statuses written through
    MLflow's own API by a login allowed to write the sweep (one it was shared with, or the server's admin),
    since MLflow records no author of a write; a login not allowed to write cannot write at all."""
    by_sweep: dict[str, list[RunRecord]] = {}
    for r in records:
        by_sweep.setdefault(r.sweep, []).append(r)
    lines = []
    for sweep, recs in sorted(by_sweep.items()):
        owner = next((r.owner for r in recs if r.owner), None)
        if owner is None:
            continue
        if login and login != owner:
            shared = any(login in r.shared_with for r in recs)
            lines.append(f"sweep {sweep}: belongs to login {owner}" + (f", shared with {login}" if shared else
                                                                        ""))  # fmt: skip
        others = [r for r in recs if r.others]
        if others:
            shown = "; ".join(f"{r.key} by {', '.join(r.others)}" for r in others[:10])
            lines.append(f"sweep {sweep}: {len(others)} run(s) registered or submitted by a login other than "
                         f"its owner {owner}: {shown}{'; ...' if len(others) > 10 else ''}")  # fmt: skip
    return lines

