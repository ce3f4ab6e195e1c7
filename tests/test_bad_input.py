"""A hostile user's input: one clear line, exit code 2, and nothing written.

The commands run in this process (typer's runner): each refusal must come before the store or a run
directory is touched, which `snapshot` checks byte for byte, SQLite's -wal/-shm files included (a
command that only opened the store would leave them).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdmctl.cli import app
from pdmctl.grid import GridError, expand
from pdmctl.ledger import open_ledger
from tests.conftest import sqlite_uri

WHOLE_BYTES = 64 << 20  # files up to this size are hashed whole


def _fingerprint(path: Path) -> str:
    """The sha256 of a file's bytes; for a larger file (a staged model's weights: gigabytes, mostly a hole,
    whose reading alone took a minute of CPU) its size, blocks on disk and modification time to the
    nanosecond, which any write changes, and the sha256 of its first and last MiB."""
    info = path.stat()
    if info.st_size <= WHOLE_BYTES:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        digest.update(fh.read(1 << 20))
        fh.seek(-(1 << 20), os.SEEK_END)
        digest.update(fh.read())
    return f"{info.st_size} bytes, {info.st_blocks} blocks, mtime {info.st_mtime_ns}, ends {digest.hexdigest()}"


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root -> the sha256 of its bytes (`_fingerprint`; 'dir' for a directory)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = f"link to {os.readlink(path)}"
        else:
            out[rel] = "dir" if path.is_dir() else _fingerprint(path)
    return out


@pytest.fixture
def store(workdir: Path) -> Path:
    """A store with one run in it, closed (no -wal/-shm files), to show that nothing recorded is touched."""
    ledger = open_ledger(sqlite_uri(workdir))
    specs = expand(["seed=9"], sweep="kept")
    ledger.register(specs, {s.key: str(workdir / "pdmctl-runs" / "kept" / s.key) for s in specs})
    ledger.engine.dispose()
    return workdir


def refused(workdir: Path, args: list[str], needle: str) -> str:
    before = snapshot(workdir)
    result = CliRunner().invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.output
    assert snapshot(workdir) == before
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["k=range(10,1)"], "override 'k=range(10,1)': sweeps over no values"),  # 4
        (["seed=range(0,10,0)"], "a range with step 0"),
        (["delta=range(1,1001)", "seed=range(0,1000)", "--dry-run"], "grid: 1,000,000 runs, more than"),  # 5
        (["seed=0,1,2", "--max-runs", "2"], "grid: 3 runs, more than the limit of 2"),
        (["delta=inf"], "delta: must be a finite number, got inf"),  # 9
        (["delta=nan", "--dry-run"], "delta: must be a finite number, got nan"),
        (["backend.lr=-inf"], "backend.lr: must be a finite number"),
        (["--name", ""], "sweep name: '' must be"),  # 13
        (["k=10", "k=20"], "k: given twice ('k=10' and 'k=20')"),
        (["=5"], "override '=5': malformed (no key before '=')"),
        (["--tracking-uri", "sqlite://relative.db"], "a SQLite store is sqlite:///PATH"),  # 8
        (["--tracking-uri", "foo://bar"], "unsupported scheme 'foo'"),
    ],
)
def test_sweep_refuses_bad_grids_writing_nothing(store: Path, args: list[str], needle: str) -> None:
    refused(store, ["sweep", *args], needle)


def test_a_huge_grid_is_counted_not_expanded() -> None:
    started = time.perf_counter()
    with pytest.raises(GridError, match=r"^grid: 100,000,000 runs"):
        expand(["delta=range(1,10001)", "seed=range(0,10000)"])
    assert time.perf_counter() - started < 1.0
    assert len(expand(["seed=range(0,3)", "k=10,20"], max_runs=6)) == 6  # at the limit: expanded


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("grid: 7\n", "grid: must be a mapping of key: values, got 7"),  # 6
        ("settings: 5\n", "settings: must be a list of key: value mappings, got 5"),
        ("settings: [3]\n", "settings: must be a list of key: value mappings"),
        ("grid: {seed: []}\n", "grid: seed: an empty list sweeps over no values"),
        ("grid: {seed: {a: 1}}\n", "grid: seed: must be a value or a list of values"),
        ("", "empty (give it a grid: or settings:)"),  # 13
        ("# only a comment\n", "empty (give it a grid: or settings:)"),
    ],
)
def test_malformed_sweep_files(store: Path, text: str, needle: str) -> None:
    (store / "s.yaml").write_text(text)
    refused(store, ["sweep", "--file", "s.yaml", "--dry-run"], needle)


@pytest.mark.parametrize("command", [["status"], ["sweep", "seed=0"], ["resume"], ["cancel"], ["report"]])
@pytest.mark.parametrize("damage", ["not sqlite", "truncated"])
def test_a_damaged_store_is_named_and_left_alone(store: Path, command: list[str], damage: str) -> None:  # 7
    db = store / "mlflow.db"
    data = db.read_bytes()
    db.write_bytes(
        b"this is not a database at all" * 100 if damage == "not sqlite" else data[: len(data) // 3]
    )
    for index in store.glob("mlflow.db-*"):  # SQLite's -wal/-shm of the store as it was
        index.unlink()
    refused(store, command, f"tracking store {db}: not a usable MLflow database")


def test_status_on_an_unreachable_server_answers_within_10_s(workdir: Path) -> None:  # 8
    started = time.perf_counter()
    line = refused(workdir, ["status", "--tracking-uri", "http://127.0.0.1:9/"], "not reachable")
    assert time.perf_counter() - started < 10, line


def test_a_store_that_does_not_exist_is_said_so(workdir: Path) -> None:  # 13
    refused(workdir, ["status", "--tracking-uri", "sqlite:////nonexistent/dir/mlflow.db"], "does not exist")
    refused(workdir, ["cancel", "zzzz"], "'zzzz': no such sweep or run (no store at")


def test_a_read_only_run_directory_is_refused_before_anything_is_registered(tmp_path: Path) -> None:  # 10
    # root writes anywhere: as root, the command runs as nobody, for whom 0o555 means read-only (and
    # pytest's own tmp_path, 0o700, is out of reach: this test works in a directory of its own)
    as_root = os.geteuid() == 0
    work = Path(tempfile.mkdtemp(dir="/tmp" if as_root else tmp_path))
    try:
        work.chmod(0o777)
        runs = work / "pdmctl-runs"
        runs.mkdir()
        runs.chmod(0o555)
        (work / "local.yaml").write_text(f"name: ro\nexecutor: local\nworkdir: {runs / 'sub'}\n")
        before = snapshot(work)
        command = [sys.executable, "-m", "pdmctl.cli", "sweep", "seed=0", "--cluster", "local.yaml"]
        if as_root:
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HOME": str(work)}
        env.pop("MLFLOW_TRACKING_URI", None)
        proc = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300, env=env)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert lines == [f"error: run directory {runs / 'sub'}: {runs} is not writable"], proc.stderr
        assert snapshot(work) == before  # no store, no lock file, no run directory
    finally:
        shutil.rmtree(work)


def test_job_json_replaced_by_a_directory(store: Path) -> None:  # 11
    (run,) = open_ledger(sqlite_uri(store)).runs("kept")
    job_json = Path(run.run_dir) / "job.json"
    job_json.mkdir(parents=True)
    db = store / "mlflow.db"
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    result = CliRunner().invoke(app, ["resume", "kept"])
    assert result.exit_code == 2, result.output
    assert (
        result.stderr.strip() == f"error: run {run.key}: {job_json} must be a file; move it away, then resume"
    )
    assert sorted(p.name for p in Path(run.run_dir).iterdir()) == ["job.json"]  # no job.tmpNNN left
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert not (store / "pdmctl-runs" / ".local" / "queue").exists() or not any(
        (store / "pdmctl-runs" / ".local" / "queue").iterdir()
    )
