"""What a job logs into its run, kept on the run's disk until the tracking server has confirmed it.

A month-long sweep meets tracking-server restarts. A metric that cannot be sent now is not retried a few
times and dropped: every entry (one step's metrics, or one JSON artifact such as an evaluation's
per-problem scores) is first appended to `<run_dir>/spool/journal.jsonl` (fsynced), then sent, in the
order it was written; `sent` (written by rename after each confirmed entry) holds how far the server has
confirmed. What the server has not confirmed stays in the journal and goes out, in order, on the next
send: the same process's next step, its end (`flush`, with backoff for a bounded time), the run's next
attempt, or `pdmctl resume`.

Once: each metric keeps the timestamp it was written with, so an entry sent again (the server confirmed
it, then the process died before writing `sent`; or a batch half-sent) is the same row to MLflow, which
drops an identical (key, step, timestamp, value) (its SQL store's primary key), and an artifact is the
same file written again. Appending and sending hold a file lock, so the TaskRunner of a job, the job
itself and `pdmctl resume` never interleave.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pdmctl.ledger.uris import _first_line, _redact

SPOOL_DIR_ENV = "PDMCTL_SPOOL_DIR"  # the run's spool, for the processes a job starts (VeRL's TaskRunner)
WAIT_ENV = "PDMCTL_TRACKING_WAIT_S"  # how long a job waits for the tracking server before it fails
DEFAULT_WAIT_S = 900.0
_BATCH = 500  # metrics per log_batch call (MLflow takes up to 1,000)


SEND_TIMEOUT_S = 30  # one HTTP call of a send; MLflow's own retries are off (the spool retries)


@contextlib.contextmanager
def quick_http() -> Iterator[None]:
    """MLflow's HTTP calls without its own retries (seven, with backoff: minutes against a server that is
    down) and with a 30 s timeout, for the duration: the spool's backoff decides when to try again, so a
    step is not held for minutes by a server that is restarting."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(SEND_TIMEOUT_S)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class SpoolError(RuntimeError):
    """The tracking server did not confirm what the spool holds within the wait; the message is one line."""


def wait_seconds() -> float:
    """`PDMCTL_TRACKING_WAIT_S` (seconds, > 0), else 900."""
    try:
        value = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    except ValueError:
        value = math.nan
    return value if 0 < value < 7 * 86400 else DEFAULT_WAIT_S


class Spool:
    """One run's journal of what it logs, and how far the tracking server has confirmed it."""

    def __init__(self, directory: Path | str, uri: str, run_id: str) -> None:
        self.dir = Path(directory)
        self.uri = uri
        self.run_id = run_id
        self.journal = self.dir / "journal.jsonl"
        self.sent_file = self.dir / "sent"
        self.last_error = ""
        self._client: Any = None
        self._thread_lock = threading.Lock()
        self._next_try = 0.0  # monotonic: no send attempt before this (backoff after a failure)
        self._backoff = 1.0

    # -- the journal ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._thread_lock, open(self.dir / "lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _position(self) -> tuple[int, int]:
        """(last confirmed entry's number, the journal's byte offset after it)."""
        try:
            data = json.loads(self.sent_file.read_text())
            return int(data["seq"]), int(data["offset"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0, 0

    def _entries(self, offset: int) -> Iterator[tuple[dict[str, Any], int]]:
        """The whole entries after `offset`, each with the offset after it (a line cut by a crash ends it)."""
        if not self.journal.exists():
            return
        with open(self.journal, "rb") as handle:
            handle.seek(offset)
            for line in handle:
                if not line.endswith(b"\n"):
                    return
                offset += len(line)
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a line spoilt by a crash mid-write: nothing of it reached the server
                yield entry, offset

    def _append(self, entry: dict[str, Any]) -> None:
        with self._locked():
            last = self._last_seq()
            entry = {"seq": last + 1, **entry}
            data = (json.dumps(entry, allow_nan=True) + "\n").encode()
            fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._seq_cache = (self.journal.stat().st_size, last + 1)

    def _last_seq(self) -> int:
        size = self.journal.stat().st_size if self.journal.exists() else 0
        cached = getattr(self, "_seq_cache", None)
        if cached and cached[0] == size:
            return cached[1]
        seq, offset = self._position()
        for entry, _ in self._entries(offset):
            seq = max(seq, int(entry.get("seq", seq)))
        return seq

    def add_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """Keep one step's metrics (sent by `send`/`flush`)."""
        if not metrics:
            return
        stamp = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        self._append({"kind": "metrics", "step": int(step), "timestamp": stamp,
                      "metrics": {k: float(v) for k, v in metrics.items()}})  # fmt: skip

    def add_artifact(self, path: str, data: Mapping[str, Any]) -> None:
        """Keep one JSON artifact of the run (`path` inside its artifact root)."""
        self._append({"kind": "artifact", "path": path, "data": dict(data)})

    def pending(self) -> list[dict[str, Any]]:
        """The entries the server has not confirmed, in order."""
        return [entry for entry, _ in self._entries(self._position()[1])]

    # -- sending --------------------------------------------------------------------------------

    def _mlflow(self):
        if self._client is None:
            from pdmctl.ledger.store import _mlflow_client

            self._client = _mlflow_client(self.uri)
        return self._client

    def _send_entry(self, entry: Mapping[str, Any]) -> None:
        client = self._mlflow()
        if entry["kind"] == "metrics":
            from mlflow.entities import Metric

            metrics = [Metric(k, float(v), int(entry["timestamp"]), int(entry["step"]))
                       for k, v in entry["metrics"].items()]  # fmt: skip
            for i in range(0, len(metrics), _BATCH):
                client.log_batch(self.run_id, metrics=metrics[i : i + _BATCH])
        elif entry["kind"] == "artifact":
            client.log_dict(self.run_id, entry["data"], entry["path"])

    def send(self, *, force: bool = False) -> int:
        """Send what the server has not confirmed, in order, until the first failure; returns how many
        entries are still unconfirmed. After a failure, later calls wait out a backoff (1 s doubling to
        60 s) unless `force`."""
        if not force and time.monotonic() < self._next_try:
            return len(self.pending())
        with self._locked(), quick_http():
            seq, offset = self._position()
            left = list(self._entries(offset))
            for i, (entry, after) in enumerate(left):
                try:
                    self._send_entry(entry)
                except Exception as exc:
                    self.last_error = _first_line(exc)[:300]
                    self._next_try = time.monotonic() + self._backoff
                    self._backoff = min(self._backoff * 2, 60.0)
                    return len(left) - i
                seq = int(entry.get("seq", seq + 1))
                self._write_position(seq, after)
            self._backoff = 1.0
            self._next_try = 0.0
            return 0

    def _write_position(self, seq: int, offset: int) -> None:
        tmp = self.sent_file.with_name(f"sent.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"seq": seq, "offset": offset}))
        os.replace(tmp, self.sent_file)

    def flush(self, limit_s: float | None = None, *, say=print) -> None:
        """Send everything, retrying with backoff (1 s doubling to 60 s) for at most `limit_s` seconds
        (`PDMCTL_TRACKING_WAIT_S`, 900); SpoolError if the server still has not confirmed it all."""
        limit = wait_seconds() if limit_s is None else limit_s
        started = time.monotonic()
        wait = 1.0
        said = False
        while (left := self.send(force=True)) > 0:
            waited = time.monotonic() - started
            if waited >= limit:
                raise SpoolError(f"tracking server {_redact(self.uri)}: {left} entries of run {self.run_id} "
                                 f"not confirmed after {waited:.0f} s ({self.last_error}); they are kept in "
                                 f"{self.journal} and sent by the next attempt or `pdmctl resume`")  # fmt: skip
            if not said:
                say(f"pdmctl: tracking server {_redact(self.uri)} does not answer ({self.last_error}); "
                    f"{left} entries kept in {self.journal}, retrying for up to {limit:.0f} s")  # fmt: skip
                said = True
            time.sleep(min(wait, max(0.0, limit - waited)))
            wait = min(wait * 2, 60.0)
        if said:
            say(f"pdmctl: tracking server {_redact(self.uri)} answers again; the spool is sent")


def spool_of(run_dir: Path | str) -> Path:
    return Path(run_dir) / "spool"


def flush_run(run_dir: Path | str, uri: str, run_id: str, limit_s: float | None = None, *, say=print) -> int:
    """Send a run's spool if it holds anything unconfirmed (a previous attempt's, or one that ended while
    the server was down); returns how many entries were pending. SpoolError if they cannot be sent."""
    directory = spool_of(run_dir)
    if not (directory / "journal.jsonl").exists():
        return 0
    spool = Spool(directory, uri, run_id)
    pending = len(spool.pending())
    if pending:
        spool.flush(limit_s, say=say)
    return pending
