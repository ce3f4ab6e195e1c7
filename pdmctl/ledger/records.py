"""What the ledger holds: its tags and statuses, a run's record, and the spec and config as MLflow
tags and params.

The tags of a run, as MLflow's UI shows them and a user filters on them (`tags.pdmctl.mask = 'pdm_agg'`):

* MLflow's own: `mlflow.runName`, `mlflow.user`, `mlflow.source.name` (`pdmctl sweep NAME`),
  `mlflow.source.type`, `mlflow.source.git.commit`, `mlflow.note.content` (the one-line summary) and
  `mlflow.parentRunId` (the sweep's parent run);
* what a run is: `pdmctl.sweep`, `pdmctl.key`, `pdmctl.mask`, `pdmctl.model`, `pdmctl.precision`,
  `pdmctl.seed`;
* where it stands (MLflow's status besides): `pdmctl.attempt`, `pdmctl.job_id`, and only while they hold,
  `pdmctl.reason` (why it ended) and `pdmctl.notice` (what its attempt wants the user to know);
  `pdmctl.look` on a seed added after that look (`pdmctl seeds`), `pdmctl.login` (`.N`) on a server with
  logins;
* `pdmctl.ledger`: the ledger's own record, JSON, read by pdmctl and by no one else: the spec, the run's
  directory, the executor that runs its jobs, the submission about to go out (an intent the executor is
  asked about where its job id never reached the ledger) and each attempt's provenance. A record longer
  than MLflow's limit on a tag's value goes on in `pdmctl.ledger.1`, `pdmctl.ledger.2`, ... Its writers
  follow one another: the registration, the submitter (under the ledger's lock, while no job of the run
  lives) and the run's job (its provenance).

The run's spec is also the artifact `spec.json`, and its config the params (`mask.method`, `delta`, ...).

Runs recorded in the older layout, tag by tag (`pdmctl.spec` and its parts, `pdmctl.run_dir`,
`pdmctl.executor`, `pdmctl.submission` with `pdmctl.submitted`, `pdmctl.prov.*`, `pdmctl.summary`), are read
as before (`legacy_state`); what a newer pdmctl writes into such a run goes into `pdmctl.ledger` and is read
over the older tags, field by field.
"""

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
TAG_SWEEP, TAG_KEY = "pdmctl.sweep", "pdmctl.key"
TAG_MASK, TAG_MODEL, TAG_PRECISION, TAG_SEED = "pdmctl.mask", "pdmctl.model", "pdmctl.precision", "pdmctl.seed"
TAG_JOB, TAG_ATTEMPT = "pdmctl.job_id", "pdmctl.attempt"
TAG_REASON = "pdmctl.reason"  # why the run ended as it did (cleared when a new attempt starts)
TAG_NOTICE = "pdmctl.notice"  # what the current attempt wants the user to know (status shows it)
TAG_LOOK = "pdmctl.look"  # a seed `pdmctl seeds --submit` added after that look (provenance field `look`)
TAG_LEDGER = "pdmctl.ledger"  # the ledger's own record (JSON; see the module's docstring)
# on a sweep's parent run (no pdmctl.sweep: never one of its runs): the sweep it holds
TAG_SWEEP_RUN = "pdmctl.sweep_run"
PARENT_TAG = "mlflow.parentRunId"
# the older layout: read from runs recorded before `pdmctl.ledger`, never written
TAG_BACKEND, TAG_EXECUTOR, TAG_SPEC, TAG_SUMMARY, TAG_RUN_DIR = (
    "pdmctl.backend",
    "pdmctl.executor",
    "pdmctl.spec",
    "pdmctl.summary",
    "pdmctl.run_dir",
)
TAG_SUBMISSION, TAG_SUBMITTED = "pdmctl.submission", "pdmctl.submitted"
# provenance (pdmctl.provenance) in the older layout: `pdmctl.prov.<field>` the latest attempt's,
# `pdmctl.prov.attempt.<n>` each attempt's job id, start and code (JSON); the look was `pdmctl.prov.look`
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
READ_TAGS = (NOTE_TAG, PARENT_TAG)
# on a tracking server with logins a sweep belongs to the login that created its experiment (`pdmctl.owner`),
# which may share it (`pdmctl.shared_with`: a JSON list of the logins that may also write it); a run records
# the login that registered it (`pdmctl.login`) and the one that submitted each attempt (`pdmctl.login.N`)
TAG_OWNER, TAG_SHARED, TAG_LOGIN = "pdmctl.owner", "pdmctl.shared_with", "pdmctl.login"
LOGIN_ENV = "MLFLOW_TRACKING_USERNAME"
# avg@16 (MLflow allows no "@"): the mean of the held-out sets at an evaluation, a fraction as eval/NAME is.
# Runs of an older pdmctl logged it in % as `avg16`; no reader reads either (pdmctl.ledger.logger)
AVG16_METRIC = "heldout/avg16"
SPEC_ARTIFACT = "spec.json"  # the run's spec, for people (the ledger reads its copy in pdmctl.ledger)
REPORT_ARTIFACTS = "report"  # where `pdmctl report` puts its files in the sweep's parent run

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
    parent: str | None = None  # its sweep's parent run (mlflow.parentRunId), where it has one

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


def _tags_for(spec: RunSpec, run_dir: str, commit: str | None = None, parent: str | None = None) -> dict[str, str]:
    """A new run's tags: MLflow's (name, user, source, commit, description, parent), what the run is, and the
    ledger's record (its spec and directory); none empty."""
    c = spec.config
    tags = {
        RUN_NAME_TAG: run_name(spec),
        USER_TAG: getpass.getuser(),
        SOURCE_NAME_TAG: f"pdmctl sweep {spec.sweep}",
        SOURCE_TYPE_TAG: "JOB",
        NOTE_TAG: spec.summary[:_TAG_VALUE_MAX],
        TAG_SWEEP: spec.sweep,
        TAG_KEY: spec.key,
        TAG_MASK: str(c["mask"]["name"]),
        TAG_MODEL: str(c["model"]["name"]),
        TAG_PRECISION: str(c["precision"]["name"]),
        TAG_SEED: str(c["seed"]),
        TAG_ATTEMPT: "0",
        **ledger_tags({"spec": spec.to_json(), "run_dir": run_dir}),
        PARENT_TAG: parent or "",
    }
    if commit and commit != "unknown":
        tags[COMMIT_TAG] = commit
    return {k: v for k, v in tags.items() if v}


def spec_artifact(spec_json: str) -> str:
    """`spec.json`: the spec as people read it (indented); the ledger reads its own copy."""
    return json.dumps(json.loads(spec_json), indent=2, sort_keys=True) + "\n"


def sweep_run_tags(sweep: str) -> dict[str, str]:
    """The tags of a sweep's parent run: no `pdmctl.sweep`, so no reader of the sweep's runs counts it."""
    return {RUN_NAME_TAG: f"sweep {sweep}", USER_TAG: getpass.getuser(), SOURCE_NAME_TAG: f"pdmctl sweep {sweep}",
            SOURCE_TYPE_TAG: "JOB", TAG_SWEEP_RUN: sweep,
            NOTE_TAG: f"The sweep {sweep}: its runs are this run's children; `pdmctl report {sweep}` logs its "
                      f"files here, under {REPORT_ARTIFACTS}/."}  # fmt: skip


def submitting_commit() -> str | None:
    """The commit of the pdmctl checkout that registers the runs (None outside a git checkout)."""
    from pdmctl.provenance import git_state

    commit = git_state()["commit"]
    return None if commit == "unknown" else commit


def _parts(tag: str, text: str) -> dict[str, str]:
    """`text` of any length as tags within MLflow's limit on a tag's value: `tag` holds the first part,
    `tag.1`, `tag.2`, ... the rest."""
    parts = [text[i : i + _TAG_VALUE_MAX] for i in range(0, len(text), _TAG_VALUE_MAX)] or [""]
    return {tag if i == 0 else f"{tag}.{i}": part for i, part in enumerate(parts)}


def _joined(tags: Mapping[str, str], tag: str) -> str | None:
    first = tags.get(tag)
    if first is None:
        return None
    parts, i = [first], 1
    while (part := tags.get(f"{tag}.{i}")) is not None:
        parts.append(part)
        i += 1
    return "".join(parts)


def ledger_tags(state: Mapping[str, Any]) -> dict[str, str]:
    """The ledger's record as its tags (`pdmctl.ledger`, then `pdmctl.ledger.1`, ... where it is long)."""
    return _parts(TAG_LEDGER, json.dumps(dict(state), sort_keys=True, separators=(",", ":")))


def ledger_state(tags: Mapping[str, str]) -> dict[str, Any]:
    """The ledger's record a run's tags hold (`pdmctl.ledger`); {} where there is none, or none readable."""
    text = _joined(tags, TAG_LEDGER)
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stale_ledger_parts(tags: Mapping[str, str], state: Mapping[str, Any]) -> list[str]:
    """The parts of the record in `tags` that a shorter `state` no longer fills (to delete)."""
    kept = ledger_tags(state)
    return [k for k in tags if k.startswith(f"{TAG_LEDGER}.") and k not in kept]


def legacy_state(tags: Mapping[str, str]) -> dict[str, Any]:
    """The ledger's record of a run recorded in the older layout, tag by tag (the module's docstring)."""
    prov = {k.removeprefix(TAG_PROVENANCE): v for k, v in tags.items() if k.startswith(TAG_PROVENANCE)}
    attempts = {k.removeprefix("attempt."): v for k, v in prov.items() if k.startswith("attempt.")}
    state: dict[str, Any] = {
        "spec": _joined(tags, TAG_SPEC), "run_dir": tags.get(TAG_RUN_DIR), "executor": tags.get(TAG_EXECUTOR),
        "submission": tags.get(TAG_SUBMISSION), "submitted": tags.get(TAG_SUBMITTED),
        "provenance": {k: v for k, v in prov.items() if not k.startswith("attempt.")},
        "attempts": {n: _json_or_none(v) for n, v in attempts.items()},
    }  # fmt: skip
    return {k: v for k, v in state.items() if v}


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return None


def run_state(tags: Mapping[str, str]) -> dict[str, Any]:
    """The ledger's record of a run, whichever layout recorded it: `pdmctl.ledger` read over the older tags,
    field by field (provenance and attempts merged, the newer's winning)."""
    old, new = legacy_state(tags), ledger_state(tags)
    state = {**old, **new}
    for name in ("provenance", "attempts"):
        merged = {**(old.get(name) or {}), **(new.get(name) or {})}
        if merged:
            state[name] = merged
    return state


def _attempt_of(submission: str) -> int | None:
    try:
        return int(submission.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


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
    state = run_state(tags)
    attempt = int(tags.get(TAG_ATTEMPT) or 0)
    submission = state.get("submission") or None
    submitted = state.get("submitted") or None
    # a submission is confirmed once the attempt it starts is recorded (with its job id, by the submitter or
    # the job); the older layout also recorded it as `pdmctl.submitted`
    wanted = _attempt_of(submission) if submission else None
    if submission and wanted is not None and attempt >= wanted:
        submitted = submission
    provenance = {str(k): str(v) for k, v in (state.get("provenance") or {}).items()}
    provenance.update({f"attempt.{n}": json.dumps(a) for n, a in (state.get("attempts") or {}).items() if a})
    look = tags.get(TAG_LOOK)
    if look:
        provenance["look"] = look
    return RunRecord(
        run_id=run_id,
        sweep=tags.get(TAG_SWEEP, ""),
        key=tags.get(TAG_KEY, ""),
        status=status,
        attempt=attempt,
        job_id=tags.get(TAG_JOB) or None,
        executor=state.get("executor") or None,
        spec_json=state.get("spec") or None,
        summary=tags.get(TAG_SUMMARY) or tags.get(NOTE_TAG, ""),  # pdmctl.summary: ledgers before the note
        run_dir=state.get("run_dir") or None,
        reason=tags.get(TAG_REASON) or None,
        start_time=start,
        end_time=end,
        latest=latest,
        submission=submission,
        submitted=submitted,
        notice=tags.get(TAG_NOTICE) or None,
        provenance=provenance,
        owner=(sweep_tags or {}).get(TAG_OWNER) or None,
        shared_with=login_list((sweep_tags or {}).get(TAG_SHARED)),
        logins=logins,
        parent=tags.get(PARENT_TAG) or None,
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

