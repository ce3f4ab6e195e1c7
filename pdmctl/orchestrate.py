"""sweep, status, resume, cancel: the ledger and the executors, without a terminal.

Every operation is safe to repeat. Submissions happen under the ledger's lock:
the ledger is read, missing runs are registered, and only runs that no job is
serving are submitted, so two `pdmctl sweep` started together submit each run
once, and `resume` twice starts nothing twice.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pdmctl.added_seeds import marks_completed
from pdmctl.budget.collapse import REASON_PREFIX
from pdmctl.executors import ClusterProfile, Executor, JobRequest, JobState, load_profile, make_executor
from pdmctl.executors.base import PLACEHOLDER, ExecutorError, check_placeholders
from pdmctl.job import JobFile
from pdmctl.ledger import (
    FAILED,
    FINISHED,
    KILLED,
    TERMINAL,
    Ledger,
    RunRecord,
    Submission,
    check_reachable,
    ledger_exists,
    open_ledger,
)
from pdmctl.order import describe_order, order_runs, replicates, seed_major, settings_first  # noqa: F401
from pdmctl.spec import RunSpec


class RunState(StrEnum):
    NEW = "new"  # in the grid, not in the ledger
    UNSUBMITTED = "not started"  # registered, no job ever took it
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    PREEMPTED = "preempted"
    LOST = "lost"  # its process ended without telling the ledger
    PRUNED = "pruned"  # a tune trial its job stopped at an evaluation (pdmctl.tune)
    STOPPED = "stopped"  # its declared collapse rule ended it (pdmctl.budget.collapse): final, never resumed


RESUMABLE = frozenset({RunState.UNSUBMITTED, RunState.FAILED, RunState.CANCELLED, RunState.TIMEOUT,
                       RunState.PREEMPTED, RunState.LOST})  # fmt: skip
ACTIVE = frozenset({RunState.QUEUED, RunState.RUNNING})

# the executor's last word on a job whose run never told the ledger how it ended
_ENDED = {
    JobState.COMPLETED: (FAILED, "lost: the job exited without reporting to the ledger"),
    JobState.FAILED: (FAILED, "lost: the job process died"),
    JobState.CANCELLED: (KILLED, "cancelled"),
    JobState.TIMEOUT: (FAILED, "timeout"),
    JobState.PREEMPTED: (FAILED, "preempted"),
    JobState.NODE_FAIL: (FAILED, "lost: node failure"),
    JobState.OUT_OF_MEMORY: (FAILED, "out of memory"),
    JobState.LOST: (FAILED, "lost: the executor has no live process for it"),
    JobState.UNKNOWN: (FAILED, "lost: the executor does not know the job"),
}


@dataclass(frozen=True)
class Context:
    """Where runs live and are tracked: the cluster profile and the tracking URI."""

    profile: ClusterProfile
    tracking_uri: str

    @property
    def run_root(self) -> Path:
        return self.profile.run_root

    def run_dir_parent(self, spec_or_record: RunSpec | RunRecord) -> Path:
        """Where the directories of a key's runs go; each is named by its MLflow run id, so that runs of
        the same config in two tracking stores never share (or resume) each other's checkpoints."""
        return self.run_root / spec_or_record.sweep / spec_or_record.key

    def run_dir(self, record: RunRecord) -> Path:
        if record.run_dir:
            return Path(record.run_dir)
        return self.run_dir_parent(record) / record.run_id

    def executor_tag(self) -> str:
        return json.dumps({"executor": self.profile.executor, "profile": self.profile.name,
                           "run_root": str(self.run_root)})  # fmt: skip


@dataclass(frozen=True)
class RunView:
    """A run as `status` shows it: the ledger's record, the executor's word, the state derived from both."""

    key: str
    sweep: str
    summary: str
    state: RunState
    record: RunRecord | None
    job_state: JobState | None = None


def run_state(record: RunRecord, job: JobState | None) -> RunState:
    if record.status == FINISHED:
        return RunState.FINISHED
    if record.status == FAILED and job is not None and job.alive:
        # the job that reported the failure is alive: still ending (seconds), or the scheduler brought it
        # back (SLURM requeued it after a lost node, whose loss had failed its trainer first); its next
        # attempt resumes by itself, and a second job for the run must not start beside it
        return RunState.RUNNING if job == JobState.RUNNING else RunState.QUEUED
    if record.status in (FAILED, KILLED):
        reason = (record.reason or "").lower()
        for prefix, state in (("timeout", RunState.TIMEOUT), ("preempted", RunState.PREEMPTED),
                              ("lost", RunState.LOST), ("cancelled", RunState.CANCELLED),
                              ("pruned", RunState.PRUNED), (REASON_PREFIX, RunState.STOPPED)):  # fmt: skip
            if reason.startswith(prefix):
                return state
        return RunState.CANCELLED if record.status == KILLED else RunState.FAILED
    if not record.job_id:
        return RunState.UNSUBMITTED
    if job in (JobState.PENDING, JobState.REQUEUED):
        return RunState.QUEUED
    if job == JobState.RUNNING:
        return RunState.RUNNING
    if job is None:
        return RunState.RUNNING if record.status == "RUNNING" else RunState.QUEUED
    return RunState.LOST


# ---------------------------------------------------------------------------
# Context
# ---------------------------------------------------------------------------


def make_context(cluster: str = "local", tracking_uri: str | None = None) -> Context:
    from pdmctl.ledger import resolve_tracking_uri

    profile = load_profile(cluster)
    return Context(profile=profile, tracking_uri=resolve_tracking_uri(tracking_uri, profile.tracking_uri))


def _executor_for(record: RunRecord, ctx: Context, cache: dict[str, Executor]) -> Executor | None:
    tag = record.executor or ""
    if tag in cache:
        return cache[tag]
    try:
        info = json.loads(tag)
        try:
            profile = load_profile(info["profile"])
        except ExecutorError:
            profile = ClusterProfile(name=info["profile"], executor=info["executor"])
        profile = ClusterProfile(name=profile.name, executor=info["executor"], tracking_uri=profile.tracking_uri,
                                 workdir=info["run_root"], max_concurrent=profile.max_concurrent,
                                 options=profile.options)  # fmt: skip
        executor = make_executor(profile)
    except (ValueError, KeyError, TypeError, ExecutorError):
        executor = None
    cache[tag] = executor  # type: ignore[assignment]
    return executor


def job_states(records: Sequence[RunRecord], ctx: Context) -> dict[str, JobState]:
    """run id -> the executor's state, for runs the ledger does not call finished or cancelled (one call per
    executor). A failed run's too: its job may be alive still, or again (`run_state`)."""
    cache: dict[str, Executor] = {}
    by_executor: dict[int, tuple[Executor, list[RunRecord]]] = {}
    for r in records:
        if r.status in (FINISHED, KILLED) or not r.job_id:
            continue
        executor = _executor_for(r, ctx, cache)
        if executor is not None:
            by_executor.setdefault(id(executor), (executor, []))[1].append(r)
    out: dict[str, JobState] = {}
    for executor, recs in by_executor.values():
        states = executor.states([r.job_id for r in recs if r.job_id])
        for r in recs:
            out[r.run_id] = states.get(r.job_id or "", JobState.UNKNOWN)
    return out


def reconcile(
    ledger: Ledger, records: list[RunRecord], ctx: Context
) -> list[tuple[RunRecord, JobState | None]]:
    """Write the executor's word into the ledger: jobs submitted but never recorded (an interrupted
    submission), and jobs that ended without telling it."""
    recovered = recover_submissions(records, ctx)
    if recovered:
        ledger.mark_submitted(list(recovered.values()))
        fresh = {r.run_id: r for r in ledger.runs(records[0].sweep if _one_sweep(records) else None)}
        records = [fresh.get(r.run_id, r) for r in records]
    states = job_states(records, ctx)
    updates: dict[tuple[str, str], list[str]] = defaultdict(list)
    for r in records:
        job = states.get(r.run_id)
        if job is not None and job in _ENDED and r.status not in TERMINAL:
            status, reason = _ENDED[job]
            if job in (JobState.FAILED, JobState.COMPLETED):  # the log may say why it never reported
                error = last_error_line(log_file(r, ctx))
                if error is not None:
                    when = "" if r.status == "RUNNING" else " at start-up"
                    status, reason = FAILED, f"the job died{when}: {error}"
            updates[(status, reason)].append(r.run_id)
    for (status, reason), ids in updates.items():
        ledger.set_status(ids, status, reason=reason, only_unfinished=True)
    if updates:
        fresh = {r.run_id: r for r in ledger.runs(records[0].sweep if _one_sweep(records) else None)}
        records = [fresh.get(r.run_id, r) for r in records]
    return [(r, states.get(r.run_id)) for r in records]


_ERROR_LINE = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception|Interrupt|Exit)\b(?:: .+)?$")
_LOG_TAIL_BYTES = 64 * 1024


def last_error_line(path: Path) -> str | None:
    """The last line of a job's log that names an exception (`ValueError: ...`), if any; reads its tail."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return None
    found = [line.strip() for line in tail.splitlines() if _ERROR_LINE.match(line.strip())]
    return found[-1][:500] if found else None


def _one_sweep(records: Sequence[RunRecord]) -> bool:
    return len({r.sweep for r in records}) == 1


# ---------------------------------------------------------------------------
# Operations
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPlan:
    specs: list[RunSpec]
    states: dict[str, RunState]  # key -> state before submission

    @property
    def to_submit(self) -> list[RunSpec]:
        return [s for s in self.specs if self.states[s.key] in (RunState.NEW, RunState.UNSUBMITTED)]

    def counts(self) -> Counter:
        return Counter(self.states[s.key] for s in self.specs)


def ledger_unreachable(ctx: Context) -> str | None:
    """Why the ledger cannot be read now (a tracking server that does not answer), or None: a dry run goes on
    without it."""
    from pdmctl.ledger import LedgerError, sqlite_path

    if sqlite_path(ctx.tracking_uri) is not None:
        return None  # a file: read where it is (a missing one is an empty ledger)
    if PLACEHOLDER.search(ctx.tracking_uri):
        return f"tracking_uri {ctx.tracking_uri!r} is a placeholder"
    try:
        check_reachable(ctx.tracking_uri)
    except LedgerError as exc:
        return str(exc)
    return None


def plan(specs: list[RunSpec], ctx: Context, *, read_only: bool = True, read_ledger: bool = True,
         order: str = "answers", run_seconds: Mapping[str, float] | None = None,
         priority: Sequence[str] = ()) -> SweepPlan:
    """What a sweep would do, its runs in array order (`order_runs`): each spec's state in the ledger (nothing is
    written when read_only; nothing is read when not read_ledger: every run is new)."""
    states = {s.key: RunState.NEW for s in specs}
    if specs and read_ledger and ledger_exists(ctx.tracking_uri):
        ledger = open_ledger(ctx.tracking_uri)
        records = ledger.runs(specs[0].sweep)
        pairs = [(r, None) for r in records] if read_only else reconcile(ledger, records, ctx)
        job = job_states(records, ctx) if read_only else {}
        recovered = recover_submissions(records, ctx) if read_only else {}
        for r, js in pairs:
            if r.key in states:
                states[r.key] = (
                    RunState.QUEUED if r.run_id in recovered else run_state(r, js or job.get(r.run_id))
                )
    return SweepPlan(order_runs(specs, order, run_seconds, priority), states)


class RunDirError(OSError):
    """A run directory that cannot take a job (not writable, a file where a directory goes); one line."""


def check_before_submit(ctx: Context) -> Executor:
    """Everything that can refuse the work, before anything is written."""
    check_placeholders(ctx.profile)  # first: a placeholder tracking_uri or workdir fails less clearly below
    from pdmctl.testhooks import check_environment

    check_environment()
    check_reachable(ctx.tracking_uri)
    _check_writable(ctx.run_root)
    return check_profile(ctx)


def check_profile(ctx: Context) -> Executor:
    """The profile filled in, and the cluster able to run its jobs as profiled (what a dry run checks too)."""
    check_placeholders(ctx.profile)
    executor = make_executor(ctx.profile)
    executor.check()
    return executor


def check_runs(specs: Sequence[RunSpec], ctx: Context, executor: Executor, storage: bool = True) -> None:
    """Refuse runs the cluster cannot serve as profiled (a backend's node count; on an offline cluster, weights
    and data that are not on its storage; not looked for without `storage`: a plan made away from the cluster),
    before anything is written."""
    from pdmctl.backends.registry import flat_config, get_backend

    given, cluster = executor.nodes_per_job(), {**executor.job_settings(), "look_at_storage": storage}
    for spec in specs:
        backend, flat = get_backend(spec.backend), flat_config(spec.config)
        try:
            needed = backend.nodes(flat)
            backend.check_cluster(flat, cluster)
        except ValueError as exc:
            raise ExecutorError(f"run {spec.key} ({spec.summary}): {exc}") from exc
        if needed is not None and needed > given:  # fewer: side by side in a job's share (executors.slurm)
            raise ExecutorError(
                f"run {spec.key} ({spec.summary}) trains on {needed} node(s) but cluster {ctx.profile.name} gives "
                f"at most {given} per job: set `nodes: {needed}` in the profile, or backend.nnodes={given} for the run"
            )


def check_installed(specs: Sequence[RunSpec], ctx: Context) -> None:
    """Where the jobs run on this interpreter (the local executor; a cluster's may run in another environment),
    refuse runs whose backend trains with a module it cannot import, before anything is written."""
    from pdmctl.backends.registry import check_installed as check

    if ctx.profile.executor == "local":
        try:
            check({spec.backend for spec in specs})
        except ValueError as exc:
            raise ExecutorError(str(exc)) from None


def pin_data(specs: Sequence[RunSpec], ctx: Context) -> list[RunSpec]:
    """Each run with the digest of the data it will read in its config (`backend.data_manifest`, part of its
    key): the data directory's manifest, checked against its files (`Backend.data_digest`). A run that names a
    digest of its own must find that data there. Refusals are one line (ExecutorError), before anything is
    written."""
    from pdmctl.backends.registry import flat_config, get_backend

    cluster = make_executor(ctx.profile).job_settings()
    out: dict[str, RunSpec] = {}
    for spec in specs:
        backend, flat = get_backend(spec.backend), flat_config(spec.config)
        try:
            digest = backend.data_digest(flat, cluster)
        except ValueError as exc:
            raise ExecutorError(f"run {spec.key} ({spec.summary}): {exc}") from exc
        given = spec.config["backend"].get("data_manifest")
        if digest is not None and given not in (None, digest):
            raise ExecutorError(f"run {spec.key} ({spec.summary}): backend.data_manifest={given[:16]}... asks for other "
                                f"data than its data directory holds ({digest[:16]}...)")  # fmt: skip
        if digest is not None and given is None:
            config = json.loads(spec.config_json)
            config["backend"]["data_manifest"] = digest
            spec = RunSpec.from_config(spec.sweep, config)
        out.setdefault(spec.key, spec)
    return list(out.values())


def describe_runs(specs: Sequence[RunSpec], ctx: Context, executor: Executor, calibration: dict | None = None) -> list[str]:
    """What --dry-run prints of the jobs, per backend (VeRL: each command, its cost; `calibration`: costing's)."""
    from pdmctl.backends.registry import DescribedRun, flat_config, get_backend

    cluster = {**executor.job_settings(), "nodes": executor.nodes_per_job(), "tracking_uri": ctx.tracking_uri,
               "max_concurrent": ctx.profile.max_concurrent, "calibration": dict(calibration or {})}  # fmt: skip
    by_backend: dict[str, list[DescribedRun]] = defaultdict(list)
    for spec in specs:
        by_backend[spec.backend].append(DescribedRun(spec.key, spec.summary, flat_config(spec.config),
                                                     ctx.run_dir_parent(spec) / "RUN_ID"))  # fmt: skip
    return [line for name, runs in by_backend.items() for line in get_backend(name).describe(runs, cluster)]


def expected_seconds(specs: Sequence[RunSpec], ctx: Context, executor: Executor,
                     calibration: Mapping[str, object] | None = None) -> dict[str, float]:
    """Each run's expected time from the cost model (`budget.costing`), where it has one: the "answers"
    order ranks the settings by it."""
    from pdmctl.budget.cost import Estimate
    from pdmctl.budget.costing import estimate_specs

    found = estimate_specs(specs, ctx, executor, calibration)  # type: ignore[arg-type]
    return {key: e.seconds.expected for key, e in found.items() if isinstance(e, Estimate)}


def _check_writable(path: Path) -> None:
    """The directory, or the nearest of its parents that exists, takes new files (else RunDirError)."""
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
    except PermissionError as exc:
        raise RunDirError(f"run directory {path}: {exc.filename} cannot be entered") from exc
    if not existing.is_dir():
        raise RunDirError(f"run directory {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {path}: {existing} is not writable")


def sweep(specs: list[RunSpec], ctx: Context, order: str = "answers",
          priority: Sequence[str] = ()) -> tuple[SweepPlan, list[str]]:
    """Register the grid in the ledger and submit the runs no job serves, in array order (`order_runs`).
    Returns the plan and the job ids."""
    executor = check_before_submit(ctx)
    check_runs(specs, ctx, executor)
    check_installed(specs, ctx)
    seconds = expected_seconds(specs, ctx, executor) if order == "answers" else None
    order_runs(specs, order, seconds, priority)  # a priority no run matches: refused before anything is written
    ledger = open_ledger(ctx.tracking_uri)
    with marks_completed(ledger):  # the lock, and first the look marks an interrupted `seeds --submit` left
        ledger.register(specs, {s.key: str(ctx.run_dir_parent(s)) for s in specs})
        current = plan(specs, ctx, read_only=False, order=order, run_seconds=seconds, priority=priority)
        by_key = {r.key: r for r in ledger.runs(specs[0].sweep)} if specs else {}
        records = [by_key[s.key] for s in current.to_submit]
        job_ids = _submit(records, ledger, executor, ctx)
    return current, job_ids


def status(ctx: Context, sweep_name: str | None = None) -> list[RunView]:
    if not ledger_exists(ctx.tracking_uri):
        return []
    ledger = open_ledger(ctx.tracking_uri)
    records = ledger.runs(sweep_name)
    if not records:
        return []
    return [
        RunView(r.key, r.sweep, r.summary, run_state(r, js), r, js)
        for r, js in reconcile(ledger, records, ctx)
    ]


def send_spools(ctx: Context, sweep_name: str | None = None, limit_s: float = 60.0) -> list[str]:
    """Send what runs kept on their disks while the tracking server was down and no attempt sent since
    (ledger.spool): one line per run that had any, saying what was sent or why it still waits."""
    from pdmctl.ledger.spool import SpoolError, flush_run, spool_of

    lines = []
    for view in status(ctx, sweep_name):
        r = view.record
        if r is None or not r.run_dir or not (spool_of(r.run_dir) / "journal.jsonl").exists():
            continue
        try:
            sent = flush_run(r.run_dir, ctx.tracking_uri, r.run_id, limit_s, say=lambda _line: None)
        except SpoolError as exc:
            lines.append(f"{view.key}: {exc}")
            continue
        if sent:
            lines.append(f"{view.key}: sent {sent} entries its run kept while the tracking server was down")
    return lines


def resume(ctx: Context, sweep_name: str | None = None, *, max_attempts: int | None = None,
           dry_run: bool = False, say: Callable[[str], None] | None = None) -> tuple[list[RunView], list[str]]:  # fmt: skip
    """Resubmit exactly the runs that failed, were cancelled, timed out, were lost or never started. With
    `say`, what runs kept on their disks during a tracking-server outage is sent first (`send_spools`),
    once everything that can refuse the work has been checked, each line to `say`."""
    executor = check_before_submit(ctx)
    ledger = open_ledger(ctx.tracking_uri) if ledger_exists(ctx.tracking_uri) else None
    if ledger is None:
        return [], []
    if say is not None and not dry_run:
        for line in send_spools(ctx, sweep_name):
            say(line)
    with marks_completed(ledger, write=not dry_run):  # as in `sweep`
        views = status(ctx, sweep_name)
        # a run whose recorded config cannot be read (cut by an older pdmctl) would only die again
        chosen = [v for v in views if v.state in RESUMABLE and v.record is not None
                  and v.record.spec is not None and ledger.writable(v.record)  # another login's: left
                  and (max_attempts is None or v.record.attempt < max_attempts)]  # fmt: skip
        check_runs([spec for v in chosen if v.record and (spec := v.record.spec)], ctx, executor)
        if dry_run:
            return chosen, []
        check_installed([spec for v in chosen if v.record and (spec := v.record.spec)], ctx)
        job_ids = _submit([v.record for v in chosen if v.record], ledger, executor, ctx)
    return chosen, job_ids


def cancel(ctx: Context, target: str | None) -> list[RunView]:
    """Cancel a sweep's live runs, or one run (by key, key prefix or MLflow run id)."""
    if not ledger_exists(ctx.tracking_uri):
        if target is not None:
            raise RunNotFound(f"{target!r}: no such sweep or run (no store at {ctx.tracking_uri} yet)")
        return []
    ledger = open_ledger(ctx.tracking_uri)
    views = status(ctx, None)
    sweeps = {v.sweep for v in views}
    if target is None or target in sweeps:
        chosen = [v for v in views if (target is None or v.sweep == target) and ledger.writable(v.record)]
    else:  # a run of another login's sweep: refused
        chosen = [v for v in [find_run(views, target)] if ledger.writable(v.record, refuse=True)]
    live = [v for v in chosen if v.state in ACTIVE or v.state == RunState.UNSUBMITTED]
    cache: dict[str, Executor] = {}
    by_executor: dict[int, tuple[Executor, list[str]]] = {}
    for v in live:
        assert v.record is not None
        executor = _executor_for(v.record, ctx, cache)
        if executor is not None and v.record.job_id:
            by_executor.setdefault(id(executor), (executor, []))[1].append(v.record.job_id)
    for executor, job_ids in by_executor.values():
        executor.cancel(job_ids)
    ledger.set_status(
        [v.record.run_id for v in live if v.record], KILLED, reason="cancelled by pdmctl cancel"
    )
    return live


class RunNotFound(LookupError):
    pass


def find_run(views: Sequence[RunView], target: str) -> RunView:
    matches = [
        v for v in views if v.key.startswith(target) or (v.record and v.record.run_id.startswith(target))
    ]
    if not matches:
        raise RunNotFound(f"run {target!r}: no run with that key or run id")
    if len({v.key for v in matches}) > 1:
        raise RunNotFound(f"run {target!r}: ambiguous, matches {', '.join(sorted({v.key for v in matches}))}")
    return matches[0]


def log_file(record: RunRecord, ctx: Context, attempt: int | None = None) -> Path:
    return ctx.run_dir(record) / "logs" / f"attempt-{attempt if attempt is not None else record.attempt}.log"


def _submit(records: Sequence[RunRecord], ledger: Ledger, executor: Executor, ctx: Context) -> list[str]:
    """Submit one job per record. The intent is in the ledger before the executor sees a job: whatever
    interrupts this, `recover_submissions` later finds the jobs that went out, so none goes out twice."""
    if not records:
        return []
    for r in records:  # every run directory, before anything is written into any of them
        run_dir = ctx.run_dir(r)
        _check_writable(run_dir)
        job_file, logs = run_dir / "job.json", run_dir / "logs"
        if job_file.is_dir():
            raise RunDirError(f"run {r.key}: {job_file} must be a file; move it away, then resume")
        if logs.exists() and not logs.is_dir():
            raise RunDirError(f"run {r.key}: {logs} must be a directory; move it away, then resume")
    from pdmctl.backends.registry import run_nodes

    token, requests, nodes = uuid.uuid4().hex[:12], [], {r.key: run_nodes(r.spec) for r in records}
    counts = list(dict.fromkeys(nodes.values()))  # the runs of one node count together: one array (`find`)
    for i, r in enumerate(sorted(records, key=lambda r: counts.index(nodes[r.key]))):
        run_dir = ctx.run_dir(r)
        attempt = r.attempt + 1
        submission = f"{token}:{i}:{attempt}"
        job_file = run_dir / "job.json"
        JobFile(run_id=r.run_id, tracking_uri=ctx.tracking_uri, spec_json=r.spec_json or "", run_dir=str(run_dir),
                attempt=attempt, executor=ctx.executor_tag(), submission=submission).write(job_file)  # fmt: skip
        requests.append(JobRequest(r.run_id, r.key, job_file, log_file(r, ctx, attempt), attempt, submission,
                                   nodes[r.key]))  # fmt: skip
    ledger.mark_intent({req.run_id: req.submission for req in requests}, ctx.executor_tag())
    job_ids = executor.submit(requests)
    ledger.mark_submitted([Submission(req.run_id, jid, ctx.executor_tag(), req.attempt, req.submission)
                           for req, jid in zip(requests, job_ids, strict=True)])  # fmt: skip
    return job_ids


def recover_submissions(records: Sequence[RunRecord], ctx: Context) -> dict[str, Submission]:
    """run id -> its job, for runs whose submission went out but never reached the ledger (reads only)."""
    cache: dict[str, Executor] = {}
    found: dict[str, Submission] = {}
    pending = [r for r in records if r.pending_submission]
    by_executor: dict[int, tuple[Executor, list[RunRecord]]] = {}
    for r in pending:
        executor = _executor_for(r, ctx, cache)
        if executor is not None:
            by_executor.setdefault(id(executor), (executor, []))[1].append(r)
    for executor, recs in by_executor.values():
        jobs = executor.find([r.pending_submission for r in recs if r.pending_submission])
        for r in recs:
            job_id = jobs.get(r.pending_submission or "")
            if job_id is not None:
                attempt = int((r.pending_submission or "").rsplit(":", 1)[1])
                found[r.run_id] = Submission(
                    r.run_id, job_id, r.executor or "", attempt, r.pending_submission or ""
                )
    return found
