"""The local executor: each job its own process, at most `max_concurrent` at a time.

Why not submitit's LocalExecutor: it starts every job at once (no concurrency
cap across submissions) and its jobs belong to the submitting Python process.
Here `pdmctl sweep` writes job files into a queue directory and makes sure a
detached worker process is draining it; the worker outlives the CLI, starts
jobs as slots free up, records how each ended, and exits when the queue is
empty. Any later `pdmctl` call restarts a worker if jobs wait without one.

    <run root>/.local/queue/<job>.json     submitted, not started
    <run root>/.local/running/<job>.json   started: pid and process start time
    <run root>/.local/done/<job>.json      ended: state and exit code
    <run root>/.local/cancel/<job>         asked to cancel
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from pdmctl.executors.base import ClusterProfile, Executor, ExecutorError, JobRequest, JobState

_POLL_S = 0.25
_HEARTBEAT_STALE_S = 30.0  # a worker touches its heartbeat every _POLL_S; this much silence is not a worker
_STRAY_GRACE_S = 3.0  # a worker ending, or one starting, is a stray for a moment at most
_CLOCK_SLACK_S = 5.0  # a heartbeat further in the future was touched by hand, not by a worker


class LocalExecutor(Executor):
    name = "local"

    def __init__(self, profile: ClusterProfile) -> None:
        super().__init__(profile)
        self.root = profile.run_root / ".local"
        self.cap = profile.max_concurrent or os.cpu_count() or 1

    def _dirs(self, *, create: bool = False) -> tuple[Path, Path, Path, Path]:
        """The queue's directories; made only where a job is written (`create`): reading never writes."""
        dirs = tuple(self.root / d for d in ("queue", "running", "done", "cancel"))
        if create:
            self._check_root()
            try:
                for d in dirs:
                    d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ExecutorError(f"local executor: {exc.filename or self.root}: {exc.strerror or exc}") from exc
        return dirs  # type: ignore[return-value]

    def _check_root(self) -> None:
        """The queue's root (`<run root>/.local`) is a directory this user can write, or can be made."""
        try:
            existing = next(p for p in (self.root, *self.root.parents) if p.exists() or p.is_symlink())
        except OSError as exc:
            raise ExecutorError(f"local executor: {self.root}: {exc.strerror or exc}") from exc
        if not existing.is_dir():
            raise ExecutorError(f"local executor: {existing} is not a directory (the job queue goes in {self.root}); "
                                "move it away, then submit again")  # fmt: skip
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ExecutorError(f"local executor: {existing} is not writable (the job queue goes in {self.root})")
        if existing == self.root:
            for name in ("queue", "running", "done", "cancel"):
                sub = self.root / name
                if (sub.exists() or sub.is_symlink()) and not (sub.is_dir() and os.access(sub, os.W_OK | os.X_OK)):
                    raise ExecutorError(f"local executor: {sub} is not a writable directory; move it away, "
                                        "then submit again")  # fmt: skip

    def submit(self, requests: Sequence[JobRequest]) -> list[str]:
        queue, *_ = self._dirs(create=True)
        job_ids = []
        for req in requests:
            job_id = _job_id(req.submission)
            # the job runs in its submitter's environment, as sbatch's --export=ALL does, whoever starts
            # the worker: `status` starts one for a queue a dead worker left, from its own environment
            _write_json(queue / f"{job_id}.json", {
                "job_file": str(req.job_file), "log_file": str(req.log_file), "run_id": req.run_id,
                "submitted": time.time(), "env": dict(os.environ),
            }, private=True)  # fmt: skip
            job_ids.append(job_id)
        if job_ids:
            ensure_worker(self.root, self.cap)
        return job_ids

    def states(self, job_ids: Sequence[str]) -> dict[str, JobState]:
        queue, running, done, _ = self._dirs()
        out: dict[str, JobState] = {}
        pending = False
        for job_id in job_ids:
            if (f := done / f"{job_id}.json").exists():
                out[job_id] = JobState(_read_json(f)["state"])
            elif (f := running / f"{job_id}.json").exists():
                info = _read_json(f)
                alive = _alive(info["pid"], info["start"])
                if not alive and (done / f"{job_id}.json").exists():  # ended between the two looks
                    out[job_id] = JobState(_read_json(done / f"{job_id}.json")["state"])
                elif alive:
                    out[job_id] = JobState.RUNNING
                else:  # its worker died before it ended: the job's own exit file says how it ended
                    rc = _exit_code(done, job_id)
                    out[job_id] = (
                        JobState.LOST if rc is None else _end_state(job_id, rc, self.root / "cancel")
                    )
            elif (queue / f"{job_id}.json").exists():
                out[job_id] = JobState.PENDING
                pending = True
            else:
                out[job_id] = JobState.LOST
        if pending:  # a worker that died leaves its queue behind: start another
            with contextlib.suppress(OSError):  # a queue this user cannot write to: status still reads
                ensure_worker(self.root, self.cap)
        return out

    def find(self, submissions: Sequence[str]) -> dict[str, str]:
        directories = self._dirs()[:3]
        found = {}
        for submission in submissions:
            job_id = _job_id(submission)
            if any((d / f"{job_id}.json").exists() for d in directories):
                found[submission] = job_id
        return found

    def check(self) -> None:
        """Refuse to queue jobs no worker would start: the worker lock held by a process that is not a
        live worker (a stray `flock`, a hung worker) would leave them queued without a word. A worker
        that is ending, or one that has just taken the lock and not yet written its pid, looks like a
        stray for a moment: only a verdict that still holds after `_STRAY_GRACE_S` refuses."""
        self._check_root()
        deadline = time.monotonic() + _STRAY_GRACE_S
        while (problem := self._stray_holder()) is not None:
            if time.monotonic() >= deadline:
                raise ExecutorError(f"local executor: {self.root / 'worker.lock'} is held by a process that is "
                                    f"not a working pdmctl worker ({problem}); end that process, then submit again")  # fmt: skip
            time.sleep(0.1)

    def _stray_holder(self) -> str | None:
        """What is wrong with the worker lock's holder, or None when no one holds it or a worker does."""
        if not _worker_alive(self.root):
            return None
        holders = _lock_holders(self.root / "worker.lock")
        if holders:  # the kernel says who holds it: it must be a worker, whatever the heartbeat file says
            strays = [pid for pid in holders if not _is_worker(pid)]
            if strays and not any(_is_worker(pid) for pid in holders):
                return f"pid {strays[0]}: {_cmdline(strays[0])[:80]}"
            return None
        # no word from the kernel (/proc/locks unreadable): the heartbeat, and the pid the worker wrote in it
        beat = self.root / "worker.heartbeat"
        try:
            age = time.time() - beat.stat().st_mtime
        except OSError:
            age = None
        pid = _heartbeat_pid(beat)
        if age is not None and -_CLOCK_SLACK_S <= age <= _HEARTBEAT_STALE_S and pid is not None and _is_worker(pid):
            return None
        if age is None:
            return "never beat"
        if age < -_CLOCK_SLACK_S:
            return f"its heartbeat is {-age:.0f} s in the future"
        return f"last beat {age:.0f} s ago" + ("" if pid is not None and _is_worker(pid) else
                                               ", and the worker that wrote it has ended")  # fmt: skip

    def cancel(self, job_ids: Sequence[str]) -> None:
        if not job_ids:
            return
        queue, running, done, cancel = self._dirs(create=True)
        for job_id in job_ids:
            (cancel / job_id).touch()
            queued = queue / f"{job_id}.json"
            try:
                queued.rename(self.root / "cancel" / f"{job_id}.queued")
                _write_json(done / f"{job_id}.json", {"state": JobState.CANCELLED.value, "returncode": None})
                continue
            except FileNotFoundError:
                pass
            info_file = running / f"{job_id}.json"
            if info_file.exists():
                info = _read_json(info_file)
                _terminate(info["pid"], info["start"])
                if not _worker_alive(self.root) and not (done / f"{job_id}.json").exists():
                    _write_json(
                        done / f"{job_id}.json", {"state": JobState.CANCELLED.value, "returncode": None}
                    )

    def describe(self, requests: Sequence[JobRequest | None], nodes: Sequence[int | None] = ()) -> str:
        return (f"{len(requests)} local process(es), at most {self.cap} at a time, "
                f"queued under {self.root}")  # fmt: skip


# ---------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------


def ensure_worker(root: Path, cap: int) -> None:
    """Start a detached worker unless one holds the lock."""
    if _worker_alive(root):
        return
    log = open(root / "worker.log", "ab")  # noqa: SIM115 (the child keeps the descriptor)
    subprocess.Popen(
        [sys.executable, "-m", "pdmctl.executors.local", "--root", str(root), "--cap", str(cap)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True,
    )  # fmt: skip
    log.close()


def _job_id(submission: str) -> str:
    """A submission's job id is a function of it, so `find` needs no record beyond the job's own files."""
    return f"local-{submission.replace(':', '-')}" if submission else f"local-{uuid.uuid4().hex[:10]}"


def _lock_holders(lock: Path) -> list[int]:
    """The pids holding a flock on `lock`, as the kernel lists them in /proc/locks ([] if unknown)."""
    try:
        st = lock.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return []
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in table.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted and fields[4].isdigit():
            pids.append(int(fields[4]))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "ended"


def _is_worker(pid: int) -> bool:
    """Whether `pid` is a live pdmctl local worker (`python -m pdmctl.executors.local ...`)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"pdmctl.executors.local" in args and _alive(pid, None)


def _heartbeat_pid(beat: Path) -> int | None:
    try:
        text = beat.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _worker_alive(root: Path) -> bool:
    lock = root / "worker.lock"
    if not lock.exists():
        return False
    try:
        fh = open(lock, "rb")  # noqa: SIM115 (closed below); read-only: looking never writes
    except OSError:
        return False
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def run_worker(root: Path, cap: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / "worker.lock", "a+")  # noqa: SIM115 (held for the worker's lifetime)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # another worker drains this queue
    queue, running, done, cancel = (root / d for d in ("queue", "running", "done", "cancel"))
    for d in (queue, running, done, cancel):
        d.mkdir(parents=True, exist_ok=True)
    children: dict[str, subprocess.Popen] = {}
    threads = max(1, (os.cpu_count() or 1) // cap)
    idle_rounds = 0
    heartbeat = root / "worker.heartbeat"
    heartbeat.write_text(str(os.getpid()))
    while True:
        heartbeat.touch()
        for job_id, proc in list(children.items()):
            rc = proc.poll()
            if rc is not None:
                _record_end(job_id, rc, running, done, cancel)
                del children[job_id]
        foreign = 0  # jobs started by a worker that died, still running
        for f in running.glob("*.json"):
            job_id = f.stem
            if job_id in children:
                continue
            info = _read_json(f)
            if _alive(info["pid"], info["start"]):
                foreign += 1
            elif not (done / f.name).exists():
                _record_foreign_end(job_id, running, done, cancel)
        free = cap - len(children) - foreign
        for f in sorted(queue.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)[: max(free, 0)]:
            job_id = f.stem
            try:
                req = _read_json(f)
            except (FileNotFoundError, json.JSONDecodeError):
                continue  # cancelled or half-written; the next round decides
            proc = _start(job_id, req, threads, done)
            kept = {k: v for k, v in req.items() if k != "env"}  # the environment stays with the job only
            _write_json(running / f.name, {"pid": proc.pid, "start": _start_time(proc.pid), **kept})
            f.unlink(missing_ok=True)
            children[job_id] = proc
        busy = children or foreign or any(queue.glob("*.json"))
        idle_rounds = 0 if busy else idle_rounds + 1
        if idle_rounds > 8:  # two seconds with nothing to do
            return
        time.sleep(_POLL_S)


def _start(job_id: str, req: dict, threads: int, done: Path) -> subprocess.Popen:
    log_file = Path(req["log_file"])
    log_file.parent.mkdir(parents=True, exist_ok=True)
    # the submitter's environment; a queue entry written before it was recorded: the worker's
    base = req["env"] if isinstance(req.get("env"), dict) else os.environ
    # less what describes a SLURM job the submitting shell was in: a local job is no requeue of it (its
    # SLURM_RESTART_COUNT would number the attempts), nor a task of its array
    base = {k: v for k, v in base.items() if k not in _SLURM_JOB_VARS}
    env = dict(base, PDMCTL_JOB_ID=job_id, PDMCTL_EXECUTOR="local", OMP_NUM_THREADS=str(threads),
               PDMCTL_NUM_THREADS=str(threads), PDMCTL_EXIT_FILE=str(_exit_file(done, job_id)))  # fmt: skip
    with open(log_file, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "pdmctl.job", req["job_file"]],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip


_SLURM_JOB_VARS = ("SLURM_RESTART_COUNT", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")


def _exit_file(done: Path, job_id: str) -> Path:
    return done / f"{job_id}.exit"


def _exit_code(done: Path, job_id: str) -> int | None:
    try:
        return int(_exit_file(done, job_id).read_text())
    except (OSError, ValueError):
        return None


def _record_foreign_end(job_id: str, running: Path, done: Path, cancel: Path) -> None:
    """A job whose worker died before it ended: its own exit file says how it ended; without one
    (killed with the worker, SIGKILL) it is lost."""
    rc = _exit_code(done, job_id)
    state = JobState.LOST if rc is None else _end_state(job_id, rc, cancel)
    _write_json(done / f"{job_id}.json", {"state": state.value, "returncode": rc})
    (running / f"{job_id}.json").unlink(missing_ok=True)


def _end_state(job_id: str, rc: int, cancel: Path) -> JobState:
    if (cancel / job_id).exists():
        return JobState.CANCELLED
    return JobState.COMPLETED if rc == 0 else JobState.FAILED


def _record_end(job_id: str, rc: int, running: Path, done: Path, cancel: Path) -> None:
    _write_json(done / f"{job_id}.json", {"state": _end_state(job_id, rc, cancel).value, "returncode": rc})
    (running / f"{job_id}.json").unlink(missing_ok=True)


def _terminate(pid: int, start: float | None, grace: float = 10.0) -> None:
    """SIGTERM the job's process group (the job marks its run KILLED), SIGKILL after a grace period."""
    if not _alive(pid, start):
        return
    with _quiet():
        os.killpg(pid, signal.SIGTERM)
    deadline = time.time() + grace
    while time.time() < deadline and _alive(pid, start):
        time.sleep(0.1)
    if _alive(pid, start):
        with _quiet():
            os.killpg(pid, signal.SIGKILL)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return exc_type is not None and issubclass(exc_type, ProcessLookupError | PermissionError)


def _start_time(pid: int) -> float | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return float(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int, start: float | None) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return False
    return start is None or float(fields[19]) == start


def _write_json(path: Path, data: dict, *, private: bool = False) -> None:
    """Write `data` whole or not at all; `private`: readable by its owner only (a submitter's environment
    may hold tokens)."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(data))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="pdmctl's local job worker (started by pdmctl itself)")
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--cap", type=int, required=True)
    args = ap.parse_args(argv)
    run_worker(args.root, args.cap)


if __name__ == "__main__":
    main()
