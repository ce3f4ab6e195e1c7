"""The executor interface, cluster profiles, and the factory.

An executor turns job requests into jobs and reports their state; nothing in
the core knows which one it talks to (submitit's shape: one small interface,
one module per backend).
"""

from __future__ import annotations

import importlib
import re
import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from pdmctl.resources import package_dir, search_path
from pdmctl.yamlfiles import load_named

CLUSTER_DIR = package_dir("clusters")  # the profiles shipped with pdmctl; lookups go along search_path("clusters")


class ExecutorError(RuntimeError):
    """A profile or a scheduler that refuses the work; the message is one line."""


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PREEMPTED = "PREEMPTED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    REQUEUED = "REQUEUED"
    LOST = "LOST"  # the executor has no record of a job it ran (its process vanished)
    UNKNOWN = "UNKNOWN"

    @property
    def alive(self) -> bool:
        return self in (JobState.PENDING, JobState.RUNNING, JobState.REQUEUED)


@dataclass(frozen=True)
class JobRequest:
    run_id: str
    key: str
    job_file: Path  # JSON the job entry point reads (see pdmctl.job)
    log_file: Path
    attempt: int
    submission: str = ""  # "token:index:attempt", recorded in the ledger before submit; see `find`
    nodes: int | None = None  # the nodes its run trains on (None: the profile's `nodes`); the fewer, side by side


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    executor: str = "local"
    tracking_uri: str | None = None
    workdir: str | None = None
    max_concurrent: int | None = None  # local: None = CPU cores; slurm: the array's %-limit
    options: dict[str, Any] = field(default_factory=dict)  # executor-specific (slurm: partition, gres, ...)

    @property
    def run_root(self) -> Path:
        given = Path(self.workdir or "pdmctl-runs").expanduser()
        try:
            return given.resolve()
        except (RuntimeError, OSError) as exc:  # a loop of symbolic links (RuntimeError before 3.13)
            raise ExecutorError(f"run directory {given}: cannot be resolved ({exc})") from exc


# the keys every profile may have, with the types they take (None: the key may be null)
PROFILE_KEYS: dict[str, tuple[type, ...]] = {
    "name": (str,), "executor": (str,), "tracking_uri": (str, type(None)), "workdir": (str, type(None)),
    "max_concurrent": (int, type(None)),
}  # fmt: skip


def load_profile(name_or_path: str) -> ClusterProfile:
    """A cluster profile, validated against its schema: the keys above, then the executor's own options
    (local: none; slurm: `SlurmOptions`). Unknown keys and wrong types are refused in one line."""
    try:
        path, data = load_named(name_or_path, search_path("clusters"), "cluster profile", ExecutorError)
    except UnicodeDecodeError as exc:
        raise ExecutorError(f"cluster profile: {name_or_path} is not UTF-8 text (byte {exc.start})") from exc
    where = f"cluster {data.get('name') if isinstance(data.get('name'), str) else Path(path).stem}"
    _refuse_control_characters(data, where)
    for key, types in PROFILE_KEYS.items():
        value = data.get(key)
        if key in data and (not isinstance(value, types) or isinstance(value, bool)):
            kinds = " or ".join("null" if t is type(None) else {str: "a string", int: "an integer"}[t] for t in types)
            raise ExecutorError(f"{where}: {key}: must be {kinds}, got {value!r}")
    profile = ClusterProfile(
        name=str(data.get("name") or path.stem),
        executor=str(data.get("executor", "local")),
        tracking_uri=data.get("tracking_uri"),
        workdir=data.get("workdir"),
        max_concurrent=data.get("max_concurrent"),
        options={k: v for k, v in data.items() if k not in PROFILE_KEYS},
    )
    if profile.executor not in EXECUTORS:
        raise ExecutorError(f"cluster {profile.name}: executor: unknown {profile.executor!r}; choose from "
                            f"{', '.join(sorted(EXECUTORS))}")  # fmt: skip
    mc = profile.max_concurrent
    if mc is not None and mc < 1:
        raise ExecutorError(f"cluster {profile.name}: max_concurrent: must be an integer >= 1, got {mc!r}")
    if profile.workdir is not None:
        try:
            Path(profile.workdir).expanduser()
        except RuntimeError as exc:  # `~nosuchuser/x`
            raise ExecutorError(f"cluster {profile.name}: workdir: {profile.workdir!r}: {exc}") from exc
        if profile.executor == "slurm" and "%" in profile.workdir:  # the job's --output/--error paths
            raise ExecutorError(f"cluster {profile.name}: workdir: {profile.workdir[:80]!r} holds '%', which SLURM "
                                "expands in a job's log path (%j: the job id, %u: the user); name a directory "
                                "without it")  # fmt: skip
    executor_class(profile).check_options(profile)  # its own keys: unknown ones and wrong types, now
    return profile


# What a profile template leaves for its user to fill in: CHANGE-ME (clusters/h20.yaml), REPLACE-ME,
# <an-angle-bracketed-name>, TODO, FIXME.
PLACEHOLDER = re.compile(r"CHANGE[-_ ]?ME|REPLACE[-_ ]?ME|<[A-Za-z][\w.-]*>|(?-i:\bTODO\b|\bFIXME\b)", re.IGNORECASE)


def placeholders(profile: ClusterProfile) -> str | None:
    """The one line naming every placeholder left in a profile's values (paths, partition, setup: lines,
    env: values, ...), or None where it has none."""
    found = [(where, text) for where, text in _values(
        {"name": profile.name, "tracking_uri": profile.tracking_uri, "workdir": profile.workdir, **profile.options}
    ) if PLACEHOLDER.search(text)]  # fmt: skip
    if not found:
        return None
    (where, text), others = found[0], [w for w, _ in found[1:]]
    also = f"; also in {', '.join(others)}" if others else ""
    return (f"cluster {profile.name}: {where} still holds the placeholder {PLACEHOLDER.search(text)[0]!r} "
            f"({text!r}){also}: fill each in before submitting (docs/CLUSTER.md)")  # fmt: skip


def check_placeholders(profile: ClusterProfile) -> None:
    """Refuse, in one line, a profile with a placeholder left in any of its values: it would go into the job
    script as it is and fail after the queue wait. A plan (a dry run) goes on beside the same line."""
    line = placeholders(profile)
    if line is not None:
        raise ExecutorError(line)


def _values(node: Any, where: str = "") -> list[tuple[str, str]]:
    """(where, text) of every string in a profile's values: `setup[1]`, `env.NCCL_SOCKET_IFNAME`."""
    if isinstance(node, Mapping):
        return [item for key, value in node.items() for item in _values(value, f"{where}.{key}" if where else str(key))]
    if isinstance(node, list | tuple):
        return [item for i, value in enumerate(node) for item in _values(value, f"{where}[{i}]")]
    return [(where, node)] if isinstance(node, str) else []


def _refuse_control_characters(value: Any, where: str, name: str = "") -> None:
    """Every text of a profile is one line: its values become `#SBATCH` lines and shell lines of the job's
    script, where a newline or a carriage return would start a line of its own (a tab: `setup` only)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_control_characters(key, where, name)
            _refuse_control_characters(item, where, f"{name}.{key}" if name else str(key))
    elif isinstance(value, list):
        for item in value:
            _refuse_control_characters(item, where, name)
    elif isinstance(value, str):
        allowed = "\t" if name == "setup" else ""
        bad = next((c for c in value if unicodedata.category(c) == "Cc" and c not in allowed), None)
        if bad is not None:
            raise ExecutorError(f"{where}: {name or 'a key'}: {value[:60]!r} holds a control character ({bad!r}); "
                                "a profile's values are one line each")  # fmt: skip


class Executor(ABC):
    name: str

    def __init__(self, profile: ClusterProfile) -> None:
        self.profile = profile

    @classmethod
    def check_options(cls, profile: ClusterProfile) -> None:
        """Refuse the profile's executor-specific keys (`options`) this executor does not know or whose
        values have the wrong type (raise ExecutorError, one line); reads the profile only."""
        if profile.options:
            unknown = sorted(profile.options)[0]
            raise ExecutorError(f"cluster {profile.name}: unknown key {unknown!r} for the {profile.executor} "
                                f"executor (known: {', '.join(PROFILE_KEYS)})")  # fmt: skip

    def check(self) -> None:
        """Refuse a profile that cannot work, before anything is submitted (raise ExecutorError)."""
        return None

    @abstractmethod
    def submit(self, requests: Sequence[JobRequest]) -> list[str]:
        """Submit every request; return their job ids, in order."""

    @abstractmethod
    def states(self, job_ids: Sequence[str]) -> Mapping[str, JobState]:
        """The executor's view of each job (one scheduler call for all where it can)."""

    @abstractmethod
    def find(self, submissions: Sequence[str]) -> Mapping[str, str]:
        """submission -> job id, for the submissions this executor holds a job for.

        How an interrupted submit is recovered: the ledger has the submission, not yet its job id.
        """

    @abstractmethod
    def cancel(self, job_ids: Sequence[str]) -> None:
        """Stop the jobs; pending ones never start."""

    def nodes_per_job(self) -> int:
        """How many nodes a job gets where its run names none, and the most one may ask for."""
        return 1

    def job_settings(self) -> dict[str, Any]:
        """What a backend's submit check reads of the cluster: offline, models_dir, data_dir."""
        return {"offline": False}

    def describe(self, requests: Sequence[JobRequest | None], nodes: Sequence[int | None] = ()) -> str:
        """What `--dry-run` prints about the submission (`nodes`: each job's, where known)."""
        return f"{len(requests)} job(s) on the {self.name} executor"


EXECUTORS = {"local": "pdmctl.executors.local:LocalExecutor", "slurm": "pdmctl.executors.slurm:SlurmExecutor"}


def executor_class(profile: ClusterProfile) -> type[Executor]:
    """The profile's executor class, imported by its entry in EXECUTORS (this module imports none of them)."""
    module, _, cls = EXECUTORS[profile.executor].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        raise ExecutorError(
            f"cluster {profile.name}: executor {profile.executor} is not available ({exc})"
        ) from exc


def make_executor(profile: ClusterProfile) -> Executor:
    return executor_class(profile)(profile)
