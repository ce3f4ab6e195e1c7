"""`pdmctl seeds --submit` cut short at any point (a kill -9, a Ctrl-C, a dropped SSH connection): whatever it
had registered is marked as added after the look before anything else reads or submits it. The next `resume`,
`seeds --submit` or `sweep` completes the marks; every added run goes out once, marked, and the report's
group-sequential interval counts it as added after the look (a fixed-size interval would be too narrow).

The jobs are queued with the local executor and never started (its worker is not launched): each queued job
file is one submission, counted here."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from pdmctl.ledger import FINISHED, TAG_PROVENANCE, open_ledger
from tests.conftest import FAST, sqlite_uri

sys.path.insert(0, str(Path(__file__).parent))  # the synthetic-sweep helpers beside this file
from test_report_synthetic import finish, make_sweep, write_points

SWEEP = "paired"
GRID = ["mask=pdm_agg,dppo_topk_kl", "seed=0,1,2", *FAST]
GAINS = {0: (0.04, 0.10), 1: (0.08, 0.02), 2: (0.01, 0.07)}  # pdm_agg over the baseline: not yet resolved


def scored(sweep, run_ids, sets=("eval/toy24", "eval/toy25"), step=6, base=(0.3, 0.4)) -> None:
    """Each run's final scores on the two sets written: the baseline's `base`, pdm_agg's GAINS (by seed) above it."""
    points = []
    for run_id in run_ids:
        spec = sweep.specs[run_id]
        gain = GAINS[spec.seed] if spec.config["mask"]["name"] == "pdm_agg" else (0.0, 0.0)
        points += [(run_id, name, step, b + g) for name, b, g in zip(sets, base, gain, strict=True)]
    write_points(sweep.ledger, points)
MAX_SEEDS = "5"  # two more seeds a row: four added runs
ADDED = 4

# runs pdmctl's CLI in this process with the local executor's worker never started (the jobs stay queued,
# one file each), and with the process killed (os._exit, as kill -9) or interrupted (KeyboardInterrupt, as
# Ctrl-C) before or after the step that KILL names
DRIVER = r"""
import os, sys
from pdmctl import orchestrate
from pdmctl.executors import local
from pdmctl.ledger.base import Ledger

local.ensure_worker = lambda root, cap: None
where, how = (os.environ.get("KILL") or ":").split(":")

def stop():
    if how == "interrupt":
        raise KeyboardInterrupt
    os._exit(9)

def cut(owner, name, when):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        if when == "before":
            stop()
        out = original(*args, **kwargs)
        stop()
        return out
    setattr(owner, name, wrapper)

if where == "after-first-mark":  # MLflow imported only here: seconds of a run that marks nothing
    from mlflow.tracking import MlflowClient
steps = {
    "before-register": lambda: (Ledger, "register", "before"),  # nothing registered yet
    "after-register": lambda: (Ledger, "register", "after"),  # the runs are in the ledger, none marked
    "after-first-mark": lambda: (MlflowClient, "log_batch", "after"),  # one run marked, the others not
    "before-submit": lambda: (orchestrate, "sweep", "before"),  # every run registered and marked, no job out
    "after-submit": lambda: (local.LocalExecutor, "submit", "after"),  # the jobs queued, the ledger not told
}
if where:
    cut(*steps[where]())
from pdmctl.cli import main
sys.argv = ["pdmctl", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished synthetic sweep of two masks and three seeds (its store file only, copied per test)."""
    where = tmp_path_factory.mktemp("base")
    sweep = make_sweep(sqlite_uri(where), SWEEP, GRID)
    scored(sweep, list(sweep.specs))
    finish(sweep.ledger, list(sweep.specs))
    sweep.ledger.engine.dispose()
    return where / "mlflow.db"


def _copy_store(source: Path, workdir: Path) -> None:
    """The store as a whole (SQLite's backup: what its write-ahead log holds too)."""
    with sqlite3.connect(source) as src, sqlite3.connect(workdir / "mlflow.db") as dst:
        src.backup(dst)


def _run(workdir: Path, *args: str, kill: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update({"COLUMNS": "200", "KILL": kill})
    return subprocess.run([sys.executable, "-c", DRIVER, *args], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def _added(workdir: Path) -> list:
    runs = open_ledger(sqlite_uri(workdir)).runs(SWEEP)
    return [r for r in runs if r.spec is not None and r.spec.seed >= 3]


def _submissions(workdir: Path) -> dict[str, int]:
    """run id -> the jobs queued for it."""
    counts: dict[str, int] = {}
    for job in (workdir / "pdmctl-runs" / ".local").glob("*/*.json"):
        run_id = json.loads(job.read_text())["run_id"]
        counts[run_id] = counts.get(run_id, 0) + 1
    return counts


def _check_marked_and_submitted_once(workdir: Path, added: int) -> None:
    runs = _added(workdir)
    assert len(runs) == added
    assert all(r.provenance.get("look") == "1" for r in runs), [(r.key, r.provenance) for r in runs]
    submitted = _submissions(workdir)
    assert {r.run_id: submitted.get(r.run_id, 0) for r in runs} == {r.run_id: 1 for r in runs}
    assert set(submitted) == {r.run_id for r in runs}  # no original run went out again
    assert not list(workdir.glob("*.seeds.json"))  # the journal is gone once its marks are made


def _report_counts_them_as_added_after_the_look(workdir: Path) -> None:
    """The added runs finished: the report's sequential code reads them as added after look 1 (stage 2)."""
    from pdmctl.budget.seeds import propose
    from pdmctl.report.collect import collect
    from pdmctl.report.definition import load_definition
    from pdmctl.report.sequential import run_look

    ledger = open_ledger(sqlite_uri(workdir))
    runs = _added(workdir)
    points = []
    for r in runs:
        gain = (0.05, 0.05) if r.spec.config["mask"]["name"] == "pdm_agg" else (0.0, 0.0)
        points += [(r.run_id, "eval/toy24", 6, 0.3 + gain[0]), (r.run_id, "eval/toy25", 6, 0.4 + gain[1])]
    write_points(ledger, points)
    finish(ledger, [r.run_id for r in runs])
    definition = load_definition("default")
    data = collect(ledger, [SWEEP], definition)
    assert all(r.status == FINISHED for r in data.records.values())
    assert {run_look(data.records[r.run_id]) for r in runs} == {1}
    look = propose(data, definition, max_seeds=10)
    assert look.look == 2 and look.proposals and {p.stages for p in look.proposals} == {2}
    assert {p.n for p in look.proposals} == {5}
    ledger.engine.dispose()


CASES = [  # (where it is cut, what follows): each cut point then resume, most then seeds --submit too
    ("before-register:kill", "resume"), ("after-register:kill", "resume"), ("after-register:kill", "seeds"),
    ("after-register:interrupt", "resume"), ("after-first-mark:kill", "resume"),
    ("after-first-mark:kill", "seeds"), ("before-submit:kill", "resume"), ("before-submit:kill", "seeds"),
    ("after-submit:kill", "resume"), ("after-submit:kill", "seeds"),
]  # fmt: skip


@pytest.mark.parametrize(("kill", "then"), CASES)
def test_an_interrupted_seeds_submit_leaves_every_added_run_marked_and_submitted_once(
    workdir: Path, finished_sweep: Path, kill: str, then: str
) -> None:
    """Cut at `kill`, then `resume` (or `seeds --submit` again, then `resume`): every added run carries the
    look mark, each goes out exactly once, and the report reads them as added after the look."""
    _copy_store(finished_sweep, workdir)
    cut = _run(workdir, "seeds", SWEEP, "--submit", "--max-seeds", MAX_SEEDS, kill=kill)
    assert cut.returncode != 0, cut.stdout + cut.stderr  # it was cut short
    registered = 0 if kill.startswith("before-register") else ADDED
    assert len(_added(workdir)) == registered

    again = ["seeds", SWEEP, "--submit", "--max-seeds", MAX_SEEDS]
    if then == "resume":
        done = _run(workdir, "resume", SWEEP)
        assert done.returncode == 0, done.stdout + done.stderr
        if registered == 0:  # nothing had been registered: resume had nothing to submit; a new look adds them
            assert _added(workdir) == [] and _submissions(workdir) == {}
            done = _run(workdir, *again)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "look 1: submitted 4 run(s)" in done.stdout, done.stdout
    else:
        done = _run(workdir, *again)
        if kill.startswith("after-submit"):  # the jobs went out: nothing is left to submit, nor to add yet
            assert done.returncode == 2, done.stdout + done.stderr
            assert "4 run(s) have not ended" in done.stderr, done.stderr
        else:
            assert done.returncode == 0, done.stdout + done.stderr
            assert "look 1: submitted 4 run(s) of seeds added after that look" in done.stdout, done.stdout
        _check_marked_and_submitted_once(workdir, ADDED)
        later = _run(workdir, "resume", SWEEP)  # and a resume after it submits nothing twice
        assert later.returncode == 0, later.stdout + later.stderr
    _check_marked_and_submitted_once(workdir, ADDED)
    _report_counts_them_as_added_after_the_look(workdir)


def test_a_sweep_after_an_interrupted_seeds_submit_marks_the_added_runs_first(
    workdir: Path, finished_sweep: Path
) -> None:
    """`pdmctl sweep` of the same sweep, whose grid now takes in an added seed, completes the marks before it
    registers or submits anything: the added run it submits goes out marked."""
    _copy_store(finished_sweep, workdir)
    cut = _run(workdir, "seeds", SWEEP, "--submit", "--max-seeds", MAX_SEEDS, kill="after-register:kill")
    assert cut.returncode != 0 and len(_added(workdir)) == ADDED
    assert all("look" not in r.provenance for r in _added(workdir))
    grid = [g if not g.startswith("seed=") else "seed=0,1,2,3" for g in GRID]
    done = _run(workdir, "sweep", "--name", SWEEP, *grid)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = _added(workdir)
    assert len(runs) == ADDED and all(r.provenance.get("look") == "1" for r in runs)
    submitted = _submissions(workdir)
    assert {r.spec.seed for r in runs if r.run_id in submitted} == {3} and set(submitted.values()) == {1}
    assert not list(workdir.glob("*.seeds.json"))


def test_a_journal_not_as_pdmctl_writes_it_is_refused_in_one_line_and_nothing_is_submitted(
    workdir: Path, finished_sweep: Path
) -> None:
    from typer.testing import CliRunner

    from pdmctl.added_seeds import journal_path
    from pdmctl.cli import app

    _copy_store(finished_sweep, workdir)
    journal = journal_path(sqlite_uri(workdir))
    journal.write_text('{"sweep": "paired", "look": "one"')
    result = CliRunner().invoke(app, ["resume", SWEEP])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {journal}: not a journal of added seeds") and "remove it" in lines[0]
    assert journal.exists() and not (workdir / "pdmctl-runs").exists()


def test_the_mark_tag_is_the_provenance_look_field(tmp_path: Path) -> None:
    """The journal's marks are the tag the report reads (`pdmctl.look`, the provenance field `look`), and a
    run marked in the older layout (`pdmctl.prov.look`) reads the same."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    from pdmctl import grid
    from pdmctl.added_seeds import mark
    from pdmctl.report.sequential import LOOK_FIELD

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ledger = open_ledger(uri)
    specs = grid.expand(["seed=0,1", "backend=synthetic", "model=synthetic"], sweep="marks")
    ids = ledger.register(specs, {s.key: str(tmp_path / s.key) for s in specs})
    new, old = ids[specs[0].key], ids[specs[1].key]
    mark(uri, [new], 2)
    MlflowClient(uri).log_batch(old, tags=[RunTag(f"{TAG_PROVENANCE}{LOOK_FIELD}", "1")])
    assert "pdmctl.look" in MlflowClient(uri).get_run(new).data.tags
    assert {r.run_id: r.provenance.get(LOOK_FIELD) for r in ledger.runs("marks")} == {new: "2", old: "1"}
