"""pdmctl seeds: on a finished testbed sweep it proposes and costs the seeds that would resolve each comparison,
submits them as ordinary runs marked with the look, and the report then reads them as added sequentially."""

from __future__ import annotations

import time
from pathlib import Path

from pdmctl.ledger import FINISHED, TERMINAL, open_ledger
from tests.conftest import FAST, pdmctl, sqlite_uri


def test_seeds_proposes_costs_and_submits_marked_runs_the_report_reads_sequentially(workdir: Path) -> None:
    made = pdmctl("sweep", "--name", "toy", "mask=pdm_agg,dppo_topk_kl", "seed=0,1", *FAST, "--wait", cwd=workdir)
    assert made.returncode == 0, made.stdout + made.stderr
    ledger = open_ledger(sqlite_uri(workdir))

    looked = pdmctl("seeds", "toy", cwd=workdir)
    assert looked.returncode == 0, looked.stdout + looked.stderr
    assert "pdm_agg vs dppo_topk_kl on toy24" in looked.stdout and "stage 1" in looked.stdout
    assert "look 1 proposes:" in looked.stdout and "CPU-hours" in looked.stdout  # costed from recorded durations
    assert "add them with --submit" in looked.stdout
    assert len(ledger.runs("toy")) == 4  # looking writes nothing

    added = pdmctl("seeds", "toy", "--submit", "--max-seeds", "3", cwd=workdir)
    assert added.returncode == 0, added.stdout + added.stderr
    assert "submitted 2 run(s)" in added.stdout
    runs = ledger.runs("toy")
    new = [r for r in runs if r.spec is not None and r.spec.seed == 2]
    assert len(runs) == 6 and len(new) == 2
    assert {r.spec.config["mask"]["name"] for r in new} == {"pdm_agg", "dppo_topk_kl"}
    assert all(r.provenance.get("look") == "1" for r in new)  # added after the first look
    assert all("look" not in r.provenance for r in runs if r not in new)

    deadline = time.monotonic() + 600
    while not all(r.status in TERMINAL for r in ledger.runs("toy")):
        assert time.monotonic() < deadline, "the added runs did not end"
        time.sleep(1)
    assert all(r.status == FINISHED for r in ledger.runs("toy"))
    report = pdmctl("report", "toy", "--panels", "none", cwd=workdir)
    assert report.returncode == 0, report.stdout + report.stderr
    text = " ".join(report.stdout.split())
    assert "group-sequential t intervals (seeds added sequentially)" in text
    assert "Seeds added sequentially" in text and "Jennison & Turnbull" in text

    again = pdmctl("seeds", "toy", "--submit", "--max-seeds", "3", cwd=workdir)  # every row at its cap
    assert again.returncode == 0 and "stage 2" in again.stdout and "nothing to add" in again.stdout
    assert len(ledger.runs("toy")) == 6


def test_seeds_refuses_bad_input_in_one_line(workdir: Path) -> None:
    few = pdmctl("seeds", "--max-seeds", "1", cwd=workdir)
    assert few.returncode == 2 and "--max-seeds: must be at least 2" in few.stderr
    none = pdmctl("seeds", "toy", cwd=workdir)
    assert none.returncode == 2 and "no ledger" in none.stderr
