"""A new embedded store is a copy of the empty store MLflow made on this machine: the same schema and
revision stamp as MLflow's own creation, its default experiment's artifacts in its own folder, usable by
MLflow's client; never written over a file that holds anything; built once per cache and made by MLflow
itself where there is no cache to keep it; a full disk leaves no half-made store."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from pdmctl.ledger import LedgerError, SqlLedger
from pdmctl.ledger.store import _mlflow_creates
from pdmctl.ledger.template import template_path


def _clauses(sql: str | None) -> list[str] | None:
    """A CREATE statement as its set of clauses: MLflow's own creations order a table's CHECK constraints
    differently from one to the next (its migrations rebuild `runs` from a set), the schema the same."""
    return None if sql is None else sorted(line.strip().rstrip(",").strip() for line in sql.splitlines())


def _schema(db: Path) -> tuple[list, list]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT type, name, sql FROM sqlite_master")
        ddl = sorted((kind, name, _clauses(sql)) for kind, name, sql in rows)
        return ddl, conn.execute("SELECT version_num FROM alembic_version").fetchall()
    finally:
        conn.close()


def _default_experiment(db: Path) -> tuple:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT name, artifact_location FROM experiments WHERE experiment_id = 0").fetchone()
    finally:
        conn.close()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDMCTL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_store_from_the_template_is_the_one_mlflow_makes_and_mlflow_uses_it(tmp_path: Path, cache: Path) -> None:
    """Created through pdmctl (the template built on the way) and by MLflow alone: the same tables, indexes
    and revision stamp; the default experiment's artifacts in the store's own mlartifacts/; MLflow's client
    opens it without migrating and logs a run into it."""
    ours, theirs = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    ours.parent.mkdir()
    theirs.parent.mkdir()
    SqlLedger(f"sqlite:///{ours}")
    assert template_path().is_file() and template_path().parent == cache / "stores"
    _mlflow_creates(f"sqlite:///{theirs}", (theirs.parent / "mlartifacts").as_uri())
    assert _schema(ours) == _schema(theirs)
    assert _default_experiment(ours) == ("Default", f"{(ours.parent / 'mlartifacts').as_uri()}/0")
    client = MlflowClient(f"sqlite:///{ours}")
    run = client.create_run(client.create_experiment("e"))
    client.log_batch(run.info.run_id, metrics=[Metric("m", 0.5, 0, 1)])
    assert client.get_run(run.info.run_id).data.metrics == {"m": 0.5}


def test_the_template_is_built_once_and_every_later_store_copies_it(tmp_path: Path, cache: Path) -> None:
    """The second and third stores do not rebuild the template (its file stays the same inode and time)."""
    SqlLedger(f"sqlite:///{tmp_path / 'one.db'}")
    first = template_path().stat()
    for name in ("two.db", "three.db"):
        SqlLedger(f"sqlite:///{tmp_path / name}")
    again = template_path().stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert _schema(tmp_path / "one.db") == _schema(tmp_path / "three.db")


def test_without_a_usable_cache_mlflow_makes_the_store_itself(tmp_path: Path, monkeypatch) -> None:
    """PDMCTL_CACHE naming a file: no template, no error; the store is MLflow's own creation."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PDMCTL_CACHE", str(blocker / "cache"))
    SqlLedger(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert _default_experiment(tmp_path / "mlflow.db")[0] == "Default"
    assert blocker.read_text() == ""


def test_a_file_that_holds_a_table_is_never_written_over(tmp_path: Path, cache: Path) -> None:
    """A SQLite file with a table of its own is no empty store: nothing is copied over it; MLflow adds its
    schema beside the table, whose rows stay."""
    db = tmp_path / "other.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.execute("INSERT INTO notes VALUES ('kept')")
    conn.commit()
    conn.close()
    SqlLedger(f"sqlite:///{db}")
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT body FROM notes").fetchall() == [("kept",)]
    conn.close()
    assert _default_experiment(db)[0] == "Default"


def test_a_full_disk_leaves_no_half_made_store_and_the_next_command_creates_it(tmp_path: Path, cache: Path) -> None:
    """A real full disk (a 128 KiB tmpfs: the empty store is about 1 MB) while the store is copied in: one
    line naming the disk, no table left behind; once space returns, the same command creates the store."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    SqlLedger(f"sqlite:///{tmp_path / 'warm.db'}")  # the template, in the cache (not on the small disk)
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)], check=True)
    try:
        uri = f"sqlite:///{disk / 'mlflow.db'}"
        with pytest.raises(LedgerError, match="disk is full") as info:
            SqlLedger(uri)
        assert "\n" not in str(info.value)
        conn = sqlite3.connect(disk / "mlflow.db")
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
        conn.close()
        subprocess.run(["mount", "-o", "remount,size=50m", str(disk)], check=True)
        SqlLedger(uri)
        assert _default_experiment(disk / "mlflow.db")[0] == "Default"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
