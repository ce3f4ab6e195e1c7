"""pdmctl seeds: on a finished testbed sweep it proposes and costs the seeds that would resolve each comparison,
submits them as ordinary runs marked with the look, and the report then reads them as added sequentially."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

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


def _synthetic(uri: str, name: str, seeds: dict[str, list[int]], values) -> object:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_report_synthetic import finish, make_sweep, write_points

    from pdmctl.report.collect import collect
    from pdmctl.report.definition import load_definition

    every = sorted({s for v in seeds.values() for s in v})
    sweep = make_sweep(uri, name, ["mask=pdm_agg,dppo_topk_kl", "seed=" + ",".join(map(str, every))])
    kept = [run_id for run_id, spec in sweep.specs.items() if spec.seed in seeds[spec.config["mask"]["name"]]]
    points = []
    for run_id in kept:
        spec = sweep.specs[run_id]
        v = values(spec.config["mask"]["name"], spec.seed)
        points += [(run_id, "eval/toy24", 4, v[0]), (run_id, "eval/toy25", 4, v[1])]
    write_points(sweep.ledger, points)
    finish(sweep.ledger, kept)
    finish(sweep.ledger, [r for r in sweep.specs if r not in kept], "KILLED")
    definition = load_definition("default")
    return collect(sweep.ledger, [name], definition), definition


def test_proposal_is_the_power_at_the_next_stage_and_adds_the_same_new_seeds_to_both_rows(tmp_path: Path) -> None:
    from pdmctl.budget.seeds import new_specs, propose
    from pdmctl.report import power

    gains = {0: (0.04, 0.10), 1: (0.08, 0.02), 2: (0.01, 0.07)}
    data, definition = _synthetic(f"sqlite:///{tmp_path / 'mlflow.db'}", "paired", {"pdm_agg": [0, 1, 2], "dppo_topk_kl": [0, 1, 2]},
                                  lambda mask, seed: (0.3 + gains[seed][0], 0.4 + gains[seed][1]) if mask == "pdm_agg" else (0.3, 0.4))  # fmt: skip
    look = propose(data, definition, max_seeds=40)
    assert look.look == 1 and look.unfinished == 0 and not look.unpaired
    by_column = {p.column: p for p in look.proposals}
    assert set(by_column) == {"toy24", "toy25", "Average"}
    for column, i in (("toy24", 0), ("toy25", 1)):
        d = np.array([gains[s][i] for s in range(3)])
        p = by_column[column]
        assert not p.resolved and p.stages == 1 and p.n == 3
        assert p.needed == power.seeds_needed(abs(d.mean()) / d.std(ddof=1), paired=True, alpha=0.05 / 4)
        assert p.extra == p.needed - 3
    # beside it, what a new sweep of fixed size would need: the number the report's power table shows
    from pdmctl.report.build import comparisons

    labels = [c.label for c in definition.columns]  # the report's columns, in order: toy24, toy25
    (row,) = comparisons(data, definition, labels)
    for label, column in zip(labels, ("toy24", "toy25"), strict=True):
        assert by_column[column].fixed == row.cells[label].seeds_needed < by_column[column].needed
    wanted = max(p.extra for p in look.proposals)
    assert sorted(look.additions.values()) == [wanted, wanted]
    specs = new_specs(data, look)
    assert sorted((s.config["mask"]["name"], s.seed) for s in specs) == sorted(
        (mask, seed) for mask in ("pdm_agg", "dppo_topk_kl") for seed in range(3, 3 + wanted))

    capped = propose(data, definition, max_seeds=4)  # at most 4 seeds a row: one more each
    assert sorted(capped.additions.values()) == [1, 1]


def test_unpaired_comparison_gets_no_seeds(tmp_path: Path) -> None:
    from pdmctl.budget.seeds import propose

    data, definition = _synthetic(f"sqlite:///{tmp_path / 'mlflow.db'}", "apart", {"pdm_agg": [0, 1], "dppo_topk_kl": [2, 3]},
                                  lambda mask, seed: (0.3 + 0.01 * seed, 0.4))  # fmt: skip
    look = propose(data, definition, max_seeds=10)
    assert look.unpaired and not look.proposals and not look.additions
