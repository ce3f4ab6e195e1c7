"""The ledger's interface: what the orchestrator asks of any store."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

from pdmctl.ledger.records import RunRecord, Submission, SweepOwnerError, tracking_login
from pdmctl.ledger.store import uri_lock
from pdmctl.spec import RunSpec


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
        self.check_owner(specs[0].sweep)  # before anything is read as this login's or written
        existing = {r.key: r.run_id for r in self.runs(specs[0].sweep)}
        new = [s for s in specs if s.key not in existing]
        if new:
            existing.update(self._create_runs(specs[0].sweep, new, run_dir))
        return existing

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

    def artifact_locations(self, run_ids: Sequence[str]) -> dict[str, str]:
        """run id -> its artifact root (MLflow's artifact_uri), for reading a run's artifacts directly."""
        raise NotImplementedError

    def sweeps(self) -> list[str]:
        return sorted({r.sweep for r in self.runs()})

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Serialise sweep/resume submissions so that concurrent invocations submit each run once."""
        return uri_lock(self.uri)
