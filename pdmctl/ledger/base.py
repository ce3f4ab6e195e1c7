"""The ledger's interface: what the orchestrator asks of any store."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path

from pdmctl.ledger.records import (
    REPORT_ARTIFACTS,
    LedgerError,
    RunRecord,
    Submission,
    SweepOwnerError,
    tracking_login,
)
from pdmctl.ledger.store import put_artifacts, uri_lock
from pdmctl.spec import RunSpec


class Ledger:
    uri: str

    def runs(self, sweep: str | None = None) -> list[RunRecord]:
        raise NotImplementedError

    def register(self, specs: Sequence[RunSpec], run_dir: Mapping[str, str]) -> dict[str, str]:
        """Create a SCHEDULED run for every spec whose key the sweep lacks, a child of the sweep's parent run
        (made with the sweep); return key -> run id for all.

        `run_dir`: key -> the directory that holds that key's runs; each run's own directory in it is
        named by its run id (see `run_dir_of`).
        """
        if not specs:
            return {}
        self.check_owner(specs[0].sweep)  # before anything is read as this login's or written
        records = self.runs(specs[0].sweep)
        existing = {r.key: r.run_id for r in records}
        new = [s for s in specs if s.key not in existing]
        parent = self.sweep_run(specs[0].sweep, create=True)
        if new:
            existing.update(self._create_runs(specs[0].sweep, new, run_dir, parent))
        self._adopt(parent, [r.run_id for r in records if r.parent != parent])
        return existing

    def sweep_run(self, sweep: str, create: bool = False) -> str | None:
        """The id of the sweep's parent run (tagged `pdmctl.sweep_run`; it has no `pdmctl.sweep`, so that no
        reader of the sweep's runs ever counts it): the active one; with `create`, one is made where there is
        none (a sweep registered before parent runs, or whose parent was deleted by hand)."""
        raise NotImplementedError

    def _adopt(self, parent: str | None, run_ids: Sequence[str]) -> None:
        """Make the runs children of `parent` (`mlflow.parentRunId`): runs older than their sweep's parent run,
        or whose parent was deleted."""
        raise NotImplementedError

    def log_report(self, sweep: str, files: Sequence[Path], root: Path) -> str:
        """Log a report's files (each under `root`) as artifacts of the sweep's parent run, under `report/`
        as they lie under `root` (a later report of the sweep replaces them); the parent is made where the sweep
        has none, and every run of the sweep made its child. Returns the parent's id; LedgerError (one line)
        where the store refuses, SweepOwnerError where the sweep is another login's."""
        self.check_owner(sweep)
        with self.lock():  # one parent per sweep, whoever else registers runs of it meanwhile
            parent = self.sweep_run(sweep, create=True)
            if parent is None:
                raise LedgerError(f"sweep {sweep!r}: no parent run could be made")
            self._adopt(parent, [r.run_id for r in self.runs(sweep) if r.parent != parent])
        location = self.artifact_locations([parent]).get(parent)
        items = [(f"{REPORT_ARTIFACTS}/{_under(Path(f), Path(root))}", Path(f)) for f in files]
        try:
            put_artifacts(self.uri, parent, location, items)
        except OSError as exc:
            raise LedgerError(f"the report's files into run {parent}: {exc.strerror or exc}") from None
        except Exception as exc:  # an artifact store MLflow's client cannot reach from here
            said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise LedgerError(f"the report's files into run {parent}: {said[:300]}") from None
        return parent

    def owner_problem(self, sweep: str, write: bool = True) -> str | None:
        """Why this login may not change (`write`) or read `sweep` here, in one line; None where it may.
        Only a tracking server with logins has owners (`ClientLedger`): a database store has none."""
        return None

    def check_owner(self, sweep: str | None, write: bool = True) -> None:
        """Refuse (SweepOwnerError) a sweep this login may not change (`write`) or read."""
        problem = None if sweep is None else self.owner_problem(sweep, write)
        if problem:
            raise SweepOwnerError(problem)

    def writable(self, record: RunRecord | None, refuse: bool = False) -> bool:
        """Whether this login may change the run (its sweep is its own, shared with it, or has no owner); with
        `refuse`, a run it may not change is SweepOwnerError instead of False."""
        if record is None or record.writable_by(tracking_login()):
            return True
        if refuse:
            raise SweepOwnerError(f"run {record.key} is in sweep {record.sweep!r}, which belongs to login "
                                  f"{record.owner}: {tracking_login()} may not change it")  # fmt: skip
        return False

    def _create_runs(
        self, sweep: str, specs: Sequence[RunSpec], run_dir: Mapping[str, str], parent: str | None = None
    ) -> dict[str, str]:
        raise NotImplementedError

    def mark_intent(self, submissions: Mapping[str, str], executor: str) -> None:
        """Record, per run id, the submission about to go out (before the executor sees it) and the executor,
        in the ledger's record (`pdmctl.ledger`). Under the ledger's lock, while no job of the run lives: the
        record has no other writer then."""
        raise NotImplementedError

    def mark_submitted(self, submissions: Sequence[Submission]) -> None:
        """Record each submission's job id and attempt (which confirm it: `RunRecord.pending_submission`);
        a reason left by the previous attempt is removed."""
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

    def artifact_locations(self, run_ids: Sequence[str]) -> dict[str, str]:
        """run id -> its artifact root (MLflow's artifact_uri), for reading a run's artifacts directly."""
        raise NotImplementedError

    def sweeps(self) -> list[str]:
        return sorted({r.sweep for r in self.runs()})

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Serialise sweep/resume submissions so that concurrent invocations submit each run once."""
        return uri_lock(self.uri)


def _under(path: Path, root: Path) -> str:
    """`path` relative to `root` (its name where it lies elsewhere)."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.name
