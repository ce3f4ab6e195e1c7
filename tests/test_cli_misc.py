"""CLI commands beyond the sweep life cycle: analyze's bad input, help, bad input on status/logs."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import pdmctl


def test_analyze_bad_input(workdir: Path):
    res = pdmctl("analyze", "--seeds", "0", cwd=workdir)
    assert res.returncode == 2 and "--seeds" in res.stderr
    res = pdmctl("analyze", "--jobs", "0", cwd=workdir)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--jobs" in res.stderr
    res = pdmctl("analyze", "k=0", cwd=workdir)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "k:" in res.stderr
    (workdir / "notes.json").write_text("not json")
    res = pdmctl("analyze", "--family", "notes.json", cwd=workdir)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--family" in res.stderr
    for protocols in ("carried,nope", "sgd,sgd", ","):
        res = pdmctl("analyze", "--protocols", protocols, cwd=workdir)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--protocols" in res.stderr


def test_analyze_engine_bad_input_is_one_line(workdir: Path):
    """`analyze --engine verl RUN_DIR --step N`: a wrong engine, a step without it, a missing run directory or a run
    without that step's snapshot, or a snapshot file that is not one, is refused in one
    line, exit 2, before any model is built."""
    (workdir / "run" / "snapshots" / "step-2").mkdir(parents=True)
    (workdir / "junk" / "snapshots" / "step-1").mkdir(parents=True)
    (workdir / "junk" / "snapshots" / "step-1" / "minibatch-0.pt").write_text("junk\n")
    for args, said in (
        (["--engine", "megatron", "run", "--step", "1"], "--engine"),
        (["--step", "1", "run"], "--step"),
        (["--engine", "verl", "--step", "1"], "name the run directory"),
        (["--engine", "verl", "run", "--step", "1"], "no snapshot of step 1 (have: step-2)"),
        (["--engine", "verl", "junk", "--step", "1"], "minibatch-0.pt: not a snapshot (not a file torch.save writes)"),
    ):
        res = pdmctl("analyze", *args, cwd=workdir)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and said in res.stderr, (args, res.stderr)


def test_status_and_logs_on_an_empty_store(workdir: Path):
    res = pdmctl("status", cwd=workdir)
    assert res.returncode == 0 and "no runs" in res.stdout
    assert not (workdir / "mlflow.db").exists()  # reading never creates a store
    res = pdmctl("status", "nope", cwd=workdir)
    assert res.returncode == 2 and "sweep 'nope': no runs" in res.stderr
    res = pdmctl("logs", "abc", cwd=workdir)
    assert res.returncode == 2 and "run 'abc'" in res.stderr
