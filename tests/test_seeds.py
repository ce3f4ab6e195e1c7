"""pdmctl seeds: on a finished testbed sweep it proposes and costs the seeds that would resolve each comparison,
submits them as ordinary runs marked with the look, and the report then reads them as added sequentially."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

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
    said = " ".join(looked.stdout.split())
    assert "95% group-sequential t interval over 2 seeds, stage 1 (at 97.5%" in said
    assert "the report's 95% t interval over 2 matched seeds (fixed size)" in said  # both shown, and why:
    assert "intervals: no seeds have been added to this sweep after looking, so the report prints" in said
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
    report = pdmctl("report", "toy", "--panels", "none", "--json", cwd=workdir)
    assert report.returncode == 0, report.stdout + report.stderr
    document = json.loads(report.stdout)
    text = " ".join((Path(document["out"]) / "results.md").read_text().split())
    assert "95% group-sequential t intervals (seeds added after look 1, the intervals pdmctl seeds gives)" in text
    assert "Seeds added sequentially" in text and "Jennison & Turnbull" in text
    (compared,) = document["comparisons"]
    label = "95% group-sequential t interval over 3 seeds, stage 2 (seeds added after look 1)"
    assert compared["interval"] == {"kind": "group-sequential", "level": 0.95, "stage": 2, "after_look": 1,
                                    "label": label}  # fmt: skip

    again = pdmctl("seeds", "toy", "--submit", "--max-seeds", "3", "--json", cwd=workdir)  # every row at its cap
    assert again.returncode == 0 and "nothing to add" in again.stderr
    assert len(ledger.runs("toy")) == 6
    names = {c["name"]: c["label"] for c in document["columns"]}
    looked_again = json.loads(again.stdout)["comparisons"]
    assert {p["column"] for p in looked_again} == set(names)
    for p in looked_again:  # seeds and the report: one interval for the comparison, under one name
        shown = compared["values"][names[p["column"]]]
        assert p["stage"] == 2 and p["interval"]["label"] == label and p["report_interval"] is None
        assert [min(100.0, max(-100.0, p[end])) for end in ("low_pp", "high_pp")] == pytest.approx(
            [shown["low_pp"], shown["high_pp"]], abs=1e-5)


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


def test_report_and_seeds_print_one_interval_for_a_comparison_and_say_which(tmp_path: Path) -> None:
    """Before any seed is added after a look, `seeds` gives the group-sequential interval at stage 1 and, beside
    it, the report's fixed-size t interval (the report's own numbers, labelled as such); once seeds are marked
    as added after look 1, the report prints the group-sequential interval `seeds` gives, under the same label,
    in its table and in its JSON."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_report_synthetic import finish, make_sweep, write_points

    from pdmctl import added_seeds
    from pdmctl.budget.seeds import look_document, propose, two_intervals
    from pdmctl.report.build import build_report
    from pdmctl.report.collect import collect
    from pdmctl.report.definition import load_definition
    from pdmctl.report.document import report_document
    from pdmctl.report.tables import comparison_table

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    definition = load_definition("default")
    rng = np.random.default_rng(8)
    sweep = make_sweep(uri, "looked", ["mask=pdm_agg,dppo_topk_kl", "seed=0,1,2,3,4"])
    points = []
    for run_id, spec in sweep.specs.items():
        gain = 0.03 if spec.config["mask"]["name"] == "pdm_agg" else 0.0
        v = rng.uniform(0.3, 0.4, 2) + gain
        points += [(run_id, "eval/toy24", 4, float(v[0])), (run_id, "eval/toy25", 4, float(v[1]))]
    write_points(sweep.ledger, points)
    finish(sweep.ledger, list(sweep.specs))

    def both():
        report = build_report(sweep.ledger, ["looked"], definition)
        data = collect(sweep.ledger, ["looked"], definition)
        look = propose(data, definition, max_seeds=10)
        (comp,) = report.comparisons
        by_column = {p.column: p for p in look.proposals}
        pairs = [(comp.cells[label].difference.interval, by_column[report.name(label)]) for label in report.labels]
        return report, (data, look), pairs, report_document(report, tmp_path, [tmp_path / "report.md"])["comparisons"][0]

    def clipped(x: float) -> float:
        return min(100.0, max(-100.0, x))

    report, (data, look), pairs, document = both()
    assert "95% t intervals over the matched seeds (fixed size)" in comparison_table(report).title
    assert "Interval of every difference: the 95% t interval over the matched seeds (fixed size" in comparison_table(report).note
    assert document["interval"]["kind"] == "fixed" and document["interval"]["stage"] is None
    assert document["interval"]["label"] == "95% t interval over 5 matched seeds (fixed size)"
    for fixed, p in pairs:
        assert p.report_interval == document["interval"]["label"] and p.stages == 1
        assert (p.report_low, p.report_high) == pytest.approx((clipped(100 * fixed.low), clipped(100 * fixed.high)))
        assert p.interval.startswith("95% group-sequential t interval over 5 seeds, stage 1 (at 97.5%")
        assert p.high - p.low > p.report_high - p.report_low  # stage 1 spends α/2: wider than the fixed one
    assert two_intervals(look, 0.95).startswith("intervals: no seeds have been added to this sweep after looking")
    seeds_json = look_document("looked", data, look, None)["comparisons"][0]
    assert seeds_json["interval"]["kind"] == "group-sequential" and seeds_json["report_interval"]["kind"] == "fixed"

    added_seeds.mark(uri, [r for r, spec in sweep.specs.items() if spec.seed >= 3], 1)  # seeds 3, 4 after look 1
    report, (data, look), pairs, document = both()
    table = comparison_table(report)
    assert "95% group-sequential t intervals (seeds added after look 1" in table.title
    assert "stage 2 (seeds added after look 1)" in table.note
    assert document["interval"] == {"kind": "group-sequential", "level": 0.95, "stage": 2, "after_look": 1,
                                    "label": "95% group-sequential t interval over 5 seeds, stage 2 (seeds added after look 1)"}  # fmt: skip
    for shown, p in pairs:
        assert not p.report_interval and p.interval == document["interval"]["label"] and p.stages == 2
        assert (clipped(p.low), clipped(p.high)) == pytest.approx((100 * shown.low, 100 * shown.high))
    assert two_intervals(look, 0.95).startswith("intervals: the report prints these same ones")
    seeds_json = look_document("looked", data, look, None)["comparisons"][0]
    assert seeds_json["interval"]["after_look"] == 1 and seeds_json["report_interval"] is None
