"""`pdmctl seeds` per setting: the comparisons of a setting whose runs have all ended are looked at and
extended while another setting of the sweep still runs; that setting's comparisons wait (no interval is
shown, nothing is added to them, no look is spent on them). Before adding, the rule's expected final seeds
and cost are stated; --max-hours caps what one look submits. The rule itself keeps the promised coverage.

The sweep is a synthetic store (two precisions of the testbed, two masks, three seeds), the finished
setting's values written, the other's runs left running; `seeds --submit` goes through the CLI with the
local executor, whose worker is never started (each queued job file is one submission). On the CI's one-node
SLURM, a testbed sweep does the same for real: its bf16 runs ended, its fp8_rollout runs running, `seeds --submit`
sends bf16's next seed to SLURM."""

from __future__ import annotations

import math
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pdmctl.ledger import open_ledger
from tests.conftest import FAST, pdmctl, sqlite_uri
from tests.test_preflight import needs_slurm

sys.path.insert(0, str(Path(__file__).parent))  # the synthetic-sweep helpers beside this file
from test_report_synthetic import finish, make_sweep
from test_seeds_interrupted import _run, _submissions, scored

SWEEP = "twosettings"
GRID = ["mask=pdm_agg,dppo_topk_kl", "seed=0,1,2", "precision=bf16,fp8_rollout", *FAST]


def _store(workdir: Path, running: str | None = "fp8_rollout") -> dict[str, str]:
    """The sweep with seed 2 of precision `running` still running, its seeds 0 and 1 ended (none: all ended);
    run id -> precision."""
    sweep = make_sweep(sqlite_uri(workdir), SWEEP, GRID)
    precision = {run_id: spec.config["precision"]["name"] for run_id, spec in sweep.specs.items()}
    ended = [run_id for run_id, p in precision.items() if p != running or sweep.specs[run_id].seed < 2]
    scored(sweep, ended)
    finish(sweep.ledger, ended)
    finish(sweep.ledger, [r for r in precision if r not in ended], "RUNNING")
    sweep.ledger.engine.dispose()
    return precision


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    """`_store(folder, running)` for the tests: each sweep built once in the module, then copied whole (SQLite's
    backup) into the test's folder."""
    built: dict[str | None, tuple[Path, dict[str, str]]] = {}

    def copy(folder: Path, running: str | None = "fp8_rollout") -> dict[str, str]:
        if running not in built:
            where = tmp_path_factory.mktemp("store")
            built[running] = (where / "mlflow.db", _store(where, running))
        source, precision = built[running]
        with sqlite3.connect(source) as src, sqlite3.connect(folder / "mlflow.db") as dst:
            src.backup(dst)
        return dict(precision)

    return copy


def test_an_ended_setting_is_looked_at_and_extended_while_another_still_runs(workdir: Path, store) -> None:
    precision = store(workdir)
    looked = _run(workdir, "seeds", SWEEP)
    assert looked.returncode == 0, looked.stdout + looked.stderr
    text = " ".join(looked.stdout.split())
    assert "bf16 pdm_agg vs dppo_topk_kl on toy24" in text and "stage 1" in text
    assert "fp8_rollout pdm_agg vs dppo_topk_kl: waiting: 2 run(s) of this setting not ended" in text
    assert text.count("waiting:") == 1  # the comparison, not its setting again
    assert "fp8_rollout pdm_agg vs dppo_topk_kl on" not in text  # no interval of a waiting setting
    assert "look 1 proposes:" in text and "the rule is expected to stop at about" in text

    added = _run(workdir, "seeds", SWEEP, "--submit", "--max-seeds", "5")
    assert added.returncode == 0, added.stdout + added.stderr
    assert "look 1: submitted 4 run(s)" in added.stdout, added.stdout
    runs = open_ledger(sqlite_uri(workdir)).runs(SWEEP)
    new = [r for r in runs if r.run_id not in precision]
    assert len(new) == 4 and {r.spec.config["precision"]["name"] for r in new} == {"bf16"}
    assert {r.spec.seed for r in new} == {3, 4} and all(r.provenance.get("look") == "1" for r in new)
    assert set(_submissions(workdir)) == {r.run_id for r in new}  # the running setting's runs untouched
    assert not list(workdir.glob("*.seeds.json"))  # the journal is gone once its marks are made

    again = _run(workdir, "seeds", SWEEP, "--submit", "--max-seeds", "5")  # both settings now wait
    assert again.returncode == 2 and "nothing to look at yet" in again.stderr, again.stdout + again.stderr
    assert set(_submissions(workdir).values()) == {1}  # nothing went out twice


def test_a_setting_extended_later_gets_its_own_stages(tmp_path: Path, store) -> None:
    """A look per comparison: a setting extended at look 2 (after another setting's look 1) counts its
    added seeds as its stage 2, as the report's group-sequential interval does."""
    from pdmctl.added_seeds import mark
    from pdmctl.budget.seeds import propose
    from pdmctl.report.collect import collect
    from pdmctl.report.definition import load_definition

    precision = store(tmp_path, running=None)
    uri = sqlite_uri(tmp_path)
    ledger = open_ledger(uri)
    seed_of = {r.run_id: r.spec.seed for r in ledger.runs(SWEEP)}
    mark(uri, [r for r, p in precision.items() if p == "bf16" and seed_of[r] == 2], 1)  # bf16's look 1
    mark(uri, [r for r, p in precision.items() if p == "fp8_rollout" and seed_of[r] == 2], 2)  # fp8's, at look 2
    definition = load_definition("default")
    look = propose(collect(ledger, [SWEEP], definition), definition, max_seeds=10)
    assert look.look == 3 and not look.waiting
    stages = {(p.setting.split(" ")[-1], p.stages) for p in look.proposals}
    assert stages == {("bf16", 2), ("fp8_rollout", 2)}  # each comparison's stages from its own looks


def test_no_ended_setting_is_refused_in_one_line(workdir: Path, store) -> None:
    store(workdir, running="bf16")
    open_ledger(sqlite_uri(workdir)).set_status(
        [r.run_id for r in open_ledger(sqlite_uri(workdir)).runs(SWEEP)], "RUNNING")  # fmt: skip
    looked = _run(workdir, "seeds", SWEEP)
    lines = [line for line in looked.stderr.splitlines() if line.strip()]
    assert looked.returncode == 2 and len(lines) == 1, looked.stdout + looked.stderr
    assert "nothing to look at yet: 12 run(s) have not ended" in lines[0]


@pytest.mark.parametrize("cap", ["0", "-1", "nan", "inf"])
def test_a_cap_of_hours_not_positive_and_finite_is_refused_in_one_line(workdir: Path, cap: str) -> None:
    from typer.testing import CliRunner

    from pdmctl.cli import app

    result = CliRunner().invoke(app, ["seeds", "--max-hours", cap])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "--max-hours" in lines[0], result.output


def test_max_hours_below_the_looks_cost_submits_nothing(workdir: Path, store) -> None:
    store(workdir, running=None)
    capped = _run(workdir, "seeds", SWEEP, "--submit", "--max-hours", "1e-9")
    assert capped.returncode == 2 and "over the cap; nothing submitted" in capped.stderr, capped.stderr
    assert len(open_ledger(sqlite_uri(workdir)).runs(SWEEP)) == 12 and _submissions(workdir) == {}


def test_cost_model_prices_rows_without_measured_hours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        store) -> None:  # fmt: skip
    """Rows whose runs have no recorded durations get the cost model's expected hours a run; recorded
    durations, where a testbed row has them, come first."""
    from pdmctl.budget import seeds as seeds_module
    from pdmctl.budget.cost import Estimate, Span
    from pdmctl.budget.seeds import Look, cost_text, run_costs

    precision = store(tmp_path, running=None)
    from pdmctl.report.collect import collect, row_keys
    from pdmctl.report.definition import load_definition

    definition = load_definition("default")
    data = collect(open_ledger(sqlite_uri(tmp_path)), [SWEEP], definition)
    keys, _, _ = row_keys(list(data.records.values()))
    rows = sorted(set(keys.values()), key=str)[:2]
    look = Look([], {rows[0]: 2, rows[1]: 2}, {r: [0, 1, 2] for r in rows}, 1, 0, [])
    measured = run_costs(data, look, {row: ("GPU", 99.0) for row in rows})
    assert {unit for unit, _ in measured.values()} == {"CPU"}  # recorded durations first
    monkeypatch.setattr(seeds_module, "row_hours", lambda data: {})  # as a row with no recorded durations
    assert "cost unknown" in cost_text(data, look)
    estimate = Estimate("GPU", 8, Span(1800.0, 1500.0, 2400.0), 3600.0, 1, "test")
    modelled = {row: (estimate.unit, estimate.hours.expected) for row in rows}
    assert run_costs(data, look, modelled) == {row: ("GPU", 4.0) for row in rows}
    assert "about 16 GPU-hours (the cost model)" in cost_text(data, look, modelled)
    assert len(precision) == 12


def test_a_verl_sweeps_added_seeds_are_priced_by_the_cost_model_without_slurm(tmp_path: Path) -> None:
    """A VeRL sweep's look (the 4B setting on the h20 profile, its weights and data staged, no `sinfo` on the
    PATH) prices the seeds it proposes with the dry run's cost model: GPU-hours, each added run at the
    model's expected hours for its spec, the total said to come from the cost model."""
    from pdmctl.budget.cost import Estimate
    from pdmctl.budget.costing import estimate_specs
    from pdmctl.executors import make_executor
    from pdmctl.orchestrate import make_context
    from tests.test_preflight import _staged_h20

    profile = _staged_h20(tmp_path)
    uri = sqlite_uri(tmp_path)
    sweep = make_sweep(uri, "v4b", ["backend=verl", "model=qwen3-4b-base", "mask=pdm_agg,dppo_topk_kl", "seed=0,1,2"])
    scored(sweep, list(sweep.specs), ("eval/aime24", "eval/aime25"), 500, (0.3, 0.2))
    finish(sweep.ledger, list(sweep.specs))
    sweep.ledger.engine.dispose()
    looked = pdmctl("seeds", "v4b", "--cluster", str(profile), "--tracking-uri", uri, cwd=tmp_path,
                    env={"PATH": str(Path(sys.executable).parent)})  # this Python, and no SLURM command
    assert looked.returncode == 0, looked.stdout + looked.stderr
    text = " ".join(looked.stdout.split())
    proposes = re.search(r"look 1 proposes: (.*?); (\d+) run\(s\), about ([\d.,]+) GPU-hours \(the cost model\)", text)
    assert proposes, text
    added = [(label, int(n)) for label, n in re.findall(r"(\S+) \+(\d+)", proposes.group(1))]
    assert added and sum(n for _, n in added) == int(proposes.group(2)), text
    ctx = make_context(str(profile), uri)
    one = {spec.config["mask"]["name"]: spec for spec in sweep.specs.values() if spec.seed == 0}
    estimates = estimate_specs(list(one.values()), ctx, make_executor(ctx.profile))
    hours = {mask: estimates[spec.key].hours.expected for mask, spec in one.items()
             if isinstance(estimates.get(spec.key), Estimate)}  # fmt: skip
    assert set(hours) == {"pdm_agg", "dppo_topk_kl"} and all(h > 1 for h in hours.values()), estimates
    expected = sum(n * hours[label] for label, n in added if label in hours)
    assert {label for label, _ in added} <= set(hours), added
    assert float(proposes.group(3).replace(",", "")) == pytest.approx(expected, abs=0.5), (text, hours)
    assert f"adding {proposes.group(3)} GPU-hours in all" in text  # the rule's expected course, the same hours


@pytest.mark.parametrize("first", [3, 4, 5])
def test_the_rule_keeps_95_percent_coverage_from_three_to_five_first_seeds(first: int) -> None:
    """Simulated under the rule `seeds` applies (power at the next stage's level, the project's
    group-sequential interval and power functions), the final interval covers at least 95%."""
    from pdmctl.budget.seeds_rule import simulate_rule

    for effect in (0.3, 0.8):
        run = simulate_rule(first, effect, 1.0, 0.05, 10, draws=3000, seed=1000 * first + int(10 * effect))
        print(f"{first} first seeds, effect {effect}: stops at {run.seeds:.2f} seeds, covers {run.coverage:.4f}")
        assert run.coverage >= 0.95
        assert first < run.seeds <= 10 and math.isfinite(run.seeds)


@pytest.mark.slurm
@needs_slurm
def test_on_slurm_an_ended_setting_is_extended_while_another_still_runs(tmp_path: Path) -> None:
    """On the CI's one-node SLURM, with the testbed: the bf16 setting's runs (two masks, seeds 0 and 1) ended,
    the fp8_rollout setting's runs running (suspended by SLURM once started, so that they stay so and cost no
    CPU). `pdmctl seeds` looks at bf16 and lets fp8_rollout's comparison wait; `--submit` sends bf16's next
    seed to SLURM as two runs marked with the look, and leaves fp8_rollout's runs as they were (the same jobs,
    one attempt each, still running)."""
    from tests.test_slurm import write_profile

    profile = write_profile(tmp_path, name="slurm-seeds", max_concurrent=4)
    where = ["--name", "onslurm", "--cluster", profile, "--tracking-uri", sqlite_uri(tmp_path)]
    masks = ["mask=pdm_agg,dppo_topk_kl", *FAST]
    ended = pdmctl("sweep", *masks, "seed=0,1", "precision=bf16", *where, "--wait", cwd=tmp_path)
    assert ended.returncode == 0, ended.stdout + ended.stderr
    longer = [o if not o.startswith("backend.steps=") else "backend.steps=400" for o in masks]
    started = pdmctl("sweep", *longer, "seed=0", "precision=fp8_rollout", *where, cwd=tmp_path)
    assert started.returncode == 0, started.stdout + started.stderr
    ledger = open_ledger(sqlite_uri(tmp_path))
    try:
        deadline = time.monotonic() + 300
        while True:
            fp8 = [r for r in ledger.runs("onslurm") if r.spec.config["precision"]["name"] == "fp8_rollout"]
            if len(fp8) == 2 and all(r.status == "RUNNING" for r in fp8):
                break
            assert time.monotonic() < deadline, [(r.key, r.status) for r in fp8]
            time.sleep(0.5)
        jobs = {r.run_id: r.job_id for r in fp8}
        for job in sorted(set(jobs.values())):
            subprocess.run(["scontrol", "suspend", job], check=True, capture_output=True, timeout=60)

        looked = pdmctl("seeds", "onslurm", *where[2:], cwd=tmp_path)
        assert looked.returncode == 0, looked.stdout + looked.stderr
        text = " ".join(looked.stdout.split())
        assert "bf16 pdm_agg vs dppo_topk_kl on toy24" in text and "stage 1" in text, text
        assert "fp8_rollout: waiting: 2 run(s) of this setting not ended" in text, text  # no values yet
        assert text.count("waiting:") == 1 and "fp8_rollout pdm_agg vs dppo_topk_kl on" not in text, text
        assert "look 1 proposes:" in text and "fp8_rollout dppo_topk_kl +" not in text, text

        added = pdmctl("seeds", "onslurm", *where[2:], "--submit", "--max-seeds", "3", cwd=tmp_path)
        assert added.returncode == 0, added.stdout + added.stderr
        assert "look 1: submitted 2 run(s)" in added.stdout, added.stdout
        runs = ledger.runs("onslurm")
        new = [r for r in runs if r.spec.seed == 2]
        assert len(runs) == 8 and len(new) == 2
        assert {r.spec.config["precision"]["name"] for r in new} == {"bf16"}
        assert all(r.provenance.get("look") == "1" and r.job_id for r in new), [(r.key, r.job_id) for r in new]
        for job in {r.job_id.split("_")[0] for r in new}:  # SLURM's jobs, not the local executor's
            shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=60)
            named = f"JobName={yaml.safe_load(Path(profile).read_text())['job_name']}"
            assert shown.returncode == 0 and named in shown.stdout, shown.stdout + shown.stderr
        after = {r.run_id: r for r in runs if r.run_id in jobs}
        assert {i: (r.job_id, r.attempt, r.status) for i, r in after.items()} == {
            i: (job, 1, "RUNNING") for i, job in jobs.items()}  # fmt: skip
    finally:
        pdmctl("cancel", "onslurm", "--yes", *where[2:], cwd=tmp_path)
