"""What a sweep is expected to cost: the model (mean response, straggler tail, start-up per attempt, checkpoint
writes) with its range under the upper bound, the dry run's lines and its JSON plan, for VeRL on the h20 profile
and for the testbed, and the figures docs/CLUSTER.md quotes."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from pdmctl.budget import cost, costing
from pdmctl.executors import load_profile, make_executor
from pdmctl.grid import expand, load_sweep_file
from pdmctl.orchestrate import Context, describe_runs, plan
from tests.conftest import pdmctl, stage_model

ROOT = Path(__file__).parents[1]


def _shape(**changes) -> cost.VerlShape:
    fields = dict(model="qwen3-4b-base", steps=300, validations=31, batch=128, group=8, response=8192,
                  held_out=60 * 16, gpus=32, checkpoint_bytes=48_000_000_000, saves=30)  # fmt: skip
    return cost.VerlShape(**{**fields, **changes})


def test_the_expected_cost_is_the_stated_model_and_its_range_lies_under_the_upper_bound() -> None:
    shape, a = _shape(), cost.ASSUMPTIONS["qwen3-4b-base"]
    estimate = cost.verl_estimate(shape, 3000, 1000, {"time": 2880})
    assert estimate is not None
    mean = a.response_fraction.expected * 8192
    tail = (a.tail_fraction.expected * 8192 - mean) / a.tail_decode.expected
    step = 128 * 8 * mean / (3000 * 32) + tail + 128 * 8 * mean / (1000 * 32)
    validation = 960 * mean / (3000 * 32) + tail
    writes = 30 * 48e9 / (a.write_gb_s.expected * 1e9)
    work = 300 * step + 31 * validation + writes
    attempts = math.ceil(work / (2880 * 60 - a.startup_s.expected))
    assert estimate.seconds.expected == pytest.approx(work + attempts * a.startup_s.expected)
    assert estimate.attempts == attempts == 1 and estimate.devices == 32 and estimate.unit == "GPU"
    at_cap = 300 * (128 * 8 * 8192 / (3000 * 32) + 128 * 8 * 8192 / (1000 * 32)) + 31 * 960 * 8192 / (3000 * 32)
    upper = at_cap + 30 * 48e9 / (a.write_gb_s.high * 1e9) + a.startup_s.high
    assert estimate.upper_s == pytest.approx(upper)
    s = estimate.seconds
    assert s.low < s.expected < s.high <= estimate.upper_s
    assert estimate.hours.expected == pytest.approx(s.expected * 32 / 3600)
    assert "not measurements" in estimate.rests_on and "mean response 33% of the cap" in estimate.assumptions


def test_a_run_longer_than_the_time_limit_pays_a_start_up_for_every_attempt() -> None:
    one = cost.verl_estimate(_shape(), 3000, 1000, {})
    short = cost.verl_estimate(_shape(), 3000, 1000, {"time": 120})  # two hours an attempt
    assert one is not None and short is not None and one.attempts == 1
    assert short.attempts == math.ceil((one.seconds.expected - 600) / (7200 - 600)) > 1
    assert short.seconds.expected == pytest.approx(one.seconds.expected + (short.attempts - 1) * 600)
    assert cost.verl_estimate(_shape(model="qwen3-tiny"), 3000, 1000, {}) is None  # no stated assumptions


def test_the_sweeps_wall_time_places_the_runs_in_order_on_the_slots() -> None:
    assert cost.wall_seconds([10, 10, 10, 10], 1) == 40
    assert cost.wall_seconds([10, 10, 10, 10], 2) == 20
    assert cost.wall_seconds([30, 10, 10, 10], 2) == 30
    assert cost.wall_seconds([], 4) == 0


def test_runs_of_fewer_nodes_share_a_slot_and_each_node_count_goes_out_as_its_own_array() -> None:
    """On slots of 4 nodes, runs of 1 node go four to a slot; the runs of one node count are placed together,
    in the order the counts first come (one array each, the earlier first); runs of a whole slot each
    are placed as without node counts."""
    assert cost.wall_seconds([10] * 8, 1, [1] * 8, 4) == 20
    assert cost.wall_seconds([10, 10, 10], 1, [4, 1, 1], 4) == 20  # the 4-node run, then both 1-node ones at once
    assert cost.wall_seconds([10, 10, 10, 10], 1, [1, 4, 1, 4], 4) == 30  # 1-node array first: 10, then 10 + 10
    assert cost.wall_seconds([30, 10, 10, 10], 2, [4] * 4, 4) == cost.wall_seconds([30, 10, 10, 10], 2) == 30
    assert cost.wall_seconds([10, 10], 1, [2, 2], 4) == 10  # 2 of 2 nodes in a 4-node slot


def _staged_h20(tmp_path: Path, **changes) -> Path:
    """clusters/h20.yaml with its placeholders pointed at staged weights and data (17,408 training rows,
    AIME 2024 and 2025 of 30 each), with `changes`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pdmctl.backends.verl import launch

    models, data = tmp_path / "models", tmp_path / "data"
    for name, preset in (("Qwen3-4B-Base", "qwen3-4b-base"), ("Qwen3-8B-Base", "qwen3-8b-base"),
                         ("Qwen3-30B-A3B-Base", "qwen3-30b-a3b-base")):  # fmt: skip
        stage_model(models / name, preset)
    data.mkdir()
    for name, rows in ((launch.TRAIN_FILE, 17_408), (launch.VAL_FILES[0], 30), (launch.VAL_FILES[1], 30)):
        pq.write_table(pa.table({"row": list(range(rows))}), data / name)
    fields = yaml.safe_load((ROOT / "clusters" / "h20.yaml").read_text())
    fields.update(models_dir=str(models), data_dir=str(data), workdir=str(tmp_path / "runs"), **changes)
    path = tmp_path / "h20.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


def _paper_main(tmp_path: Path, max_concurrent: int, small_on: int | None = None):
    """paper-main's plan on the staged h20 profile; `small_on`: its 4B and 8B settings on that many nodes
    (`backend.nnodes` in their settings), the 30B ones on the preset's 4."""
    profile = load_profile(str(_staged_h20(tmp_path, max_concurrent=max_concurrent)))
    ctx = Context(profile, f"sqlite:///{tmp_path / 'none.db'}")
    executor = make_executor(profile)
    sweep = "paper-main"
    if small_on is not None:
        fields = yaml.safe_load((ROOT / "sweeps" / "paper-main.yaml").read_text())
        for setting in fields["settings"]:
            if setting["model"] in ("qwen3-4b-base", "qwen3-8b-base"):
                setting["backend.nnodes"] = small_on
        sweep = str(tmp_path / "paper-main-packed.yaml")
        Path(sweep).write_text(yaml.safe_dump(fields))
    return ctx, executor, plan(expand([], load_sweep_file(sweep)), ctx, order="seed")


def test_paper_main_on_four_nodes_has_an_expected_cost_per_run_under_its_upper_bound_seed_zero_first(
        tmp_path: Path) -> None:  # fmt: skip
    """The JSON plan of paper-main on the h20 profile at max_concurrent 1 (a 4-node partition): every run's
    expected cost with its range below its upper bound, all arms of seed 0 before any run of seed 1, the settings'
    and the sweep's sums, and the text dry run's sweep line with the same figures."""
    ctx, executor, sweep_plan = _paper_main(tmp_path, max_concurrent=1)
    data = costing.plan_json(sweep_plan, ctx, executor, "seed")
    assert data["format"] == "pdmctl-plan/1" and data["order"] == "seed" and data["max_concurrent"] == 1
    runs = data["runs"]
    assert len(runs) == 48 and [r["order"] for r in runs] == list(range(1, 49))
    assert max(r["order"] for r in runs if r["seed"] == 0) < min(r["order"] for r in runs if r["seed"] == 1)
    for run in runs:
        c = run["cost"]
        assert c["unit"] == "GPU-hours" and c["devices"] == 32 and run["nodes"] == 4, run["key"]
        assert c["low"] < c["expected"] < c["high"] <= c["upper_bound"], c
        assert run["config"]["seed"] == run["seed"] and run["action"] == "submit"
    sweep = data["sweep_cost"]
    assert sweep["runs"] == 48 and sweep["expected"] == pytest.approx(sum(r["cost"]["expected"] for r in runs), rel=1e-3)
    assert sweep["low"] < sweep["expected"] < sweep["high"] < sweep["upper_bound"]
    assert sum(s["runs"] for s in data["settings"]) == 48
    days = sweep["wall_days"]  # one run at a time: the runs' times end to end
    assert days["expected"] * 86400 == pytest.approx(sum(r["cost"]["wall_s"]["expected"] for r in runs), rel=1e-3)
    line = describe_runs(sweep_plan.to_submit, ctx, executor)[-1]
    printed = re.match(r"sweep cost: 48 run\(s\), ([\d,]+) GPU-hours expected \(([\d,]+)-([\d,]+)\), upper bound ([\d,]+);",
                       line)  # fmt: skip
    assert printed is not None, line
    for figure, key in zip(printed.groups(), ("expected", "low", "high", "upper_bound"), strict=True):
        assert float(figure.replace(",", "")) == pytest.approx(sweep[key], rel=1e-3), key
    assert "on the profile's 4 node(s) at max_concurrent 1" in line and "not measurements" in line


def test_paper_mains_4b_and_8b_on_one_node_pack_four_to_a_share_and_shorten_the_sweep(tmp_path: Path) -> None:
    """paper-main with its 4B and 8B settings on one node each (backend.nnodes: 1) on a 4-node partition: their
    runs train on 8 GPUs (trainer.nnodes=1 in their commands), four side by side where a 30B run holds all 4
    nodes; the sweep's wall time, so placed, is shorter than with every run on 4 nodes, and the dry run says
    how the runs share the nodes."""
    ctx, executor, packed = _paper_main(tmp_path / "packed", 1, small_on=1)
    data = costing.plan_json(packed, ctx, executor, "seed")
    for run in data["runs"]:
        small = run["config"]["model"]["name"] in ("qwen3-4b-base", "qwen3-8b-base")
        assert run["nodes"] == (1 if small else 4) and run["cost"]["devices"] == (8 if small else 32), run["key"]
    lines = describe_runs(packed.to_submit, ctx, executor)
    four_b = next(i for i, line in enumerate(lines) if line.startswith("setting 1/"))
    assert "qwen3-4b-base" in lines[four_b] and "trainer.nnodes=1" in lines[four_b + 2], lines[four_b:four_b + 3]
    assert "(1 x 4 node(s) at a time; runs of 1 node(s) 4 side by side in a share)" in lines[-1], lines[-1]
    whole_ctx, whole_executor, whole_plan = _paper_main(tmp_path / "whole", 1)
    whole = costing.plan_json(whole_plan, whole_ctx, whole_executor, "seed")
    assert data["sweep_cost"]["wall_days"]["expected"] < whole["sweep_cost"]["wall_days"]["expected"]
    assert "--nodes=1" in executor.describe([None] * 48, [r["nodes"] for r in data["runs"]])


def test_the_testbeds_plan_is_json_in_cpu_hours_and_writes_nothing(workdir: Path) -> None:
    result = pdmctl("sweep", "seed=0,1", "k=10,20", "--dry-run", "--json", cwd=workdir)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # nothing else on stdout
    assert [(r["order"], r["seed"], r["replicate"]) for r in data["runs"]] == [(1, 0, 0), (2, 0, 0), (3, 1, 1), (4, 1, 1)]
    first = data["runs"][0]
    assert set(first) == {"order", "key", "summary", "setting", "seed", "replicate", "state", "action", "nodes",
                          "config", "cost", "cost_missing"}  # fmt: skip
    assert first["cost"]["unit"] == "CPU-hours" and first["cost"]["devices"] == 1 and first["cost_missing"] is None
    assert first["config"]["k"] == 10 and first["state"] == "new" and first["action"] == "submit"
    rollouts = 40 * 128 * 8  # the default toy run
    expected_s = rollouts * cost.TOY_ROLLOUT_S.expected + cost.TOY_STARTUP_S.expected
    assert first["cost"]["wall_s"]["expected"] == pytest.approx(expected_s, rel=1e-3)
    assert data["sweep_cost"]["unit"] == "CPU-hours" and data["sweep_cost"]["runs"] == 4
    assert data["sweep_cost"]["expected"] == pytest.approx(4 * expected_s / 3600, rel=1e-3)
    first_day = data["settings"][0].pop("first_comparison_day")
    assert data["settings"] == [{"setting": "toy: toy-small bf16", "runs": 4, "cost": data["sweep_cost"]}]
    assert 0 < first_day["low"] <= first_day["expected"] <= first_day["high"]
    assert first_day["expected"] <= data["sweep_cost"]["wall_days"]["expected"]
    assert list(workdir.iterdir()) == []


def test_json_without_a_dry_run_is_refused_in_one_line(workdir: Path) -> None:
    result = pdmctl("sweep", "seed=0,1", "--json", cwd=workdir)
    assert result.returncode == 2 and result.stderr.strip() == "error: --json: prints the plan of a dry run; give --dry-run too"
    assert list(workdir.iterdir()) == []


def test_the_cost_figures_in_docs_cluster_are_the_shipped_profiles_dry_run(tmp_path: Path) -> None:
    """docs/CLUSTER.md, "Cost", quotes the paper-main sweep's expected GPU-hours, range, upper bound and wall days
    on the shipped h20 profile (max_concurrent 4: 16 nodes) and on a 4-node partition (max_concurrent 1)."""
    doc = (ROOT / "docs" / "CLUSTER.md").read_text()
    section = doc[doc.index("### Cost"):]
    for slots, small_on in ((4, None), (1, None), (4, 1), (1, 1)):
        ctx, executor, sweep_plan = _paper_main(tmp_path / f"{slots}-{small_on}", slots, small_on)
        line = describe_runs(sweep_plan.to_submit, ctx, executor)[-1]
        figures = re.match(r"sweep cost: 48 run\(s\), (.+?); (.+?) of wall time expected \((.+?); upper bound (.+?)\)",
                           line)  # fmt: skip
        assert figures is not None, line
        hours, days, spread, upper = figures.groups()
        quoted = f"{hours}; {days} expected ({spread}; upper bound {upper}) at max_concurrent {slots}"
        assert quoted in section, quoted


def test_the_time_spent_is_every_attempts_wall_time_to_the_next_attempt_or_the_runs_end() -> None:
    from datetime import UTC, datetime

    from pdmctl.ledger.records import RunRecord

    def stamp(epoch: float) -> str:
        return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S%z")

    t0 = 1_800_000_000
    attempts = {"attempt.1": json.dumps({"job_id": "1", "started": stamp(t0)}),
                "attempt.2": json.dumps({"job_id": "2", "started": stamp(t0 + 3600)})}  # fmt: skip
    record = RunRecord("r", "s", "k", "FINISHED", 2, "2", "local", None, "", None, None, t0 * 1000,
                       (t0 + 5400) * 1000, provenance=attempts)  # fmt: skip
    assert cost.spent_seconds(record, now=t0 + 99_999) == 5400  # 3,600 s, then 1,800 s to the run's end
    running = RunRecord("r", "s", "k", "RUNNING", 2, "2", "local", None, "", None, None, t0 * 1000, None,
                        provenance=attempts)  # fmt: skip
    assert cost.spent_seconds(running, now=t0 + 4000) == 4000
    assert cost.spent_seconds(RunRecord("r", "s", "k", "SCHEDULED", 0, None, None, None, "", None, None, None,
                                        None), now=t0) is None  # fmt: skip


def test_status_shows_the_cpu_hours_a_finished_sweep_spent_beside_its_prediction(workdir: Path) -> None:
    from tests.conftest import FAST

    result = pdmctl("sweep", "--name", "spent", "seed=0", *FAST, "--wait", cwd=workdir)
    assert result.returncode == 0, result.stdout + result.stderr
    out = pdmctl("status", "spent", cwd=workdir)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("cost of spent: "))
    spent = float(line.split("cost of spent: ")[1].split(" CPU-hours spent by the 1 run(s) that started")[0])
    from pdmctl.ledger import open_ledger
    from tests.conftest import sqlite_uri

    (record,) = open_ledger(sqlite_uri(workdir)).runs("spent")
    wall = cost.spent_seconds(record, now=0)
    assert wall is not None and 0 < wall <= (record.end_time - record.start_time) / 1000 + 1
    assert spent == pytest.approx(wall / 3600, rel=0.05, abs=1e-4)
    assert ", predicted " in line and "CPU-hours expected (" in line and "not measurements" in line
    assert "started (from the ledger's attempt times: " in line and " left" not in line  # local runs; it ended
    table = out.stdout[out.stdout.index("spent: CPU-hours spent and predicted, per setting"):].splitlines()
    row = next(r.split() for r in table if r.startswith("toy: toy-small"))
    assert row[3:6] == ["1", "1", line.split("cost of spent: ")[1].split(" ")[0]], table
    # the same run, as status would see it still running: the rest of its predicted time, on the slots
    from pdmctl import orchestrate
    from pdmctl.budget import spent as spent_module

    ctx = orchestrate.make_context("local", sqlite_uri(workdir))
    (running,) = spent_module.sweep_costs([record], ctx, now=0, states={record.key: "running"})
    assert not isinstance(running, str) and running.left is not None and running.sweep_row.started == 1
    predicted = running.sweep_row.whole.wall_s
    assert running.left == cost.Span(*(max(0.0, getattr(predicted, k) - wall) for k in ("expected", "low", "high")))
    # the report's cost table says it too, under the table
    from types import SimpleNamespace

    from pdmctl.report.tables import cost_table

    note = cost_table(SimpleNamespace(cost=[running])).note
    assert f"Sweep spent still runs: {spent_module.left_text(running.left, running.slots)}." in note, note
    assert "still runs" not in cost_table(SimpleNamespace(cost=[dataclasses.replace(running, left=None)])).note


@pytest.mark.parametrize(("walls", "basis"), [
    ({3: 4.10, 6: 7.30}, "fitted on runs of 2 lengths"),
    ({3: 6.52, 6: 5.34}, "the stated one: the longer runs were not slower, so no fit"),
], ids=["longer-was-slower", "longer-was-not-slower"])  # fmt: skip
def test_a_calibration_fits_a_start_up_only_where_the_longer_run_was_slower(walls: dict[int, float], basis: str) -> None:
    """Two finished runs of 3 and 6 steps. Where the longer took longer, start-up + rate x rollouts is fitted
    through them; where the shorter took longer (a cold first run on a loaded machine), a line would call the
    whole run start-up and the rate 0, so the stated start-up is kept and said so. Either way each run's
    measured time lies within its own predicted range."""
    from types import SimpleNamespace

    from pdmctl.backends.registry import flat_config

    specs = expand(["seed=0", "backend.steps=3,6"], None, "calib")

    def record(spec) -> SimpleNamespace:
        steps = flat_config(spec.config)["steps"]
        return SimpleNamespace(status="FINISHED", spec=spec, key=spec.key, end_time=(1_800_000_000 + walls[steps]) * 1000,
                               attempts=[{"started": "2027-01-15T08:00:00+0000"}])  # fmt: skip

    (found,) = costing.calibrate([record(s) for s in specs], "calib").values()
    assert found.startup_basis == basis
    if basis.startswith("fitted"):
        assert 0 < found.startup_s.expected < min(walls.values()) and found.startup_s.low == found.startup_s.high
    else:
        assert found.startup_s == cost.TOY_STARTUP_S
    assert 0 < found.per_rollout_s.low <= found.per_rollout_s.high
    for spec in specs:
        flat = flat_config(spec.config)
        estimate = cost.toy_estimate(flat, {"calibration": {f"toy: {flat['model']} {flat['precision']}": found}})
        # within its range, up to the least-squares fit's rounding (a line through two points meets both)
        low, high = estimate.seconds.low * (1 - 1e-6), estimate.seconds.high * (1 + 1e-6)
        assert low <= walls[flat["steps"]] <= high, (estimate, flat["steps"])


def test_a_dry_run_calibrated_on_finished_testbed_runs_uses_their_measured_rate_and_says_so(workdir: Path) -> None:
    """Two finished runs of two lengths (3 and 6 steps) fit start-up + rate x rollouts; the calibrated plan of
    the same two runs predicts each one's measured wall time within its range, and says what it rests on."""
    from tests.conftest import FAST

    fast = [o for o in FAST if not o.startswith("backend.steps=")]
    for steps in (3, 6):
        result = pdmctl("sweep", "--name", "calib", "seed=0", f"backend.steps={steps}", *fast, "--wait", cwd=workdir)
        assert result.returncode == 0, result.stdout + result.stderr
    from pdmctl.ledger import open_ledger
    from tests.conftest import sqlite_uri

    records = open_ledger(sqlite_uri(workdir)).runs("calib")
    measured = {r.key: cost.spent_seconds(r, now=0) for r in records}
    planned = pdmctl("sweep", "--name", "calib", "seed=0", "backend.steps=3,6", *fast, "--dry-run", "--json",
                     "--calibrated-on", "calib", cwd=workdir)  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    runs = json.loads(planned.stdout)["runs"]
    assert sorted(r["key"] for r in runs) == sorted(measured)
    for run in runs:
        c = run["cost"]
        assert c["rests_on"].startswith("calibrated on 2 finished run(s) of sweep calib (")
        # a fit where the 6-step run took longer; where a cold first run on a loaded machine outweighed the work,
        # the stated start-up (both branches on fixed times: the calibration tests below)
        assert ("fitted on runs of 2 lengths" in c["assumptions"]
                or "the longer runs were not slower, so no fit" in c["assumptions"]), c["assumptions"]
        assert c["wall_s"]["low"] * 0.999 <= measured[run["key"]] <= c["wall_s"]["high"] * 1.001, (c, measured)
    text = pdmctl("sweep", "seed=0,1", *FAST, "--dry-run", "--calibrated-on", "calib", cwd=workdir)
    assert "testbed cost: 2 run(s), " in text.stdout and "rests on calibrated on 2 finished run(s) of sweep calib" in text.stdout
    stated = pdmctl("sweep", "seed=0,1", *FAST, "--dry-run", cwd=workdir)
    assert "testbed cost: 2 run(s), " in stated.stdout and "rests on the stated assumptions" in stated.stdout
    for args, message in ((["--dry-run", "--calibrated-on", "nosuch"], "--calibrated-on: no sweep 'nosuch' in "),
                          (["--calibrated-on", "calib"], "--calibrated-on: calibrates the estimates of a dry run")):  # fmt: skip
        bad = pdmctl("sweep", "seed=0", *args, cwd=workdir)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and message in bad.stderr, bad.stderr
