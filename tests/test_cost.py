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
from pdmctl.orchestrate import Context, describe_runs, expected_seconds, plan
from tests.conftest import pdmctl, stage_model

ROOT = Path(__file__).parents[1]


def _shape(**changes) -> cost.VerlShape:
    fields = dict(model="qwen3-4b-base", steps=300, validations=31, batch=128, group=8, response=8192,
                  held_out=60 * 16, gpus=32, checkpoint_bytes=48_000_000_000, saves=30)  # fmt: skip
    return cost.VerlShape(**{**fields, **changes})


def _by_hand(shape: cost.VerlShape, end: str, at_cap: bool = False) -> float:
    """One run's seconds at one end of the stated assumptions (no time limit: one attempt), as docs/CLUSTER.md,
    "Cost", writes the model."""
    a = cost.ASSUMPTIONS[shape.model]
    pick = {name: getattr(getattr(a, name), end) for name in ("response_fraction", "tail_fraction", "tail_decode",
            "startup_s", "write_gb_s", "step_fixed_s", "rollout_rate", "train_rate")}  # fmt: skip
    mean = (1.0 if at_cap else pick["response_fraction"]) * shape.response
    tail = 0.0 if at_cap else (pick["tail_fraction"] * shape.response - mean) / pick["tail_decode"]
    rollout_rate, train_rate = 4200 * pick["rollout_rate"] * shape.gpus, 2000 * pick["train_rate"] * shape.gpus
    forward = 1 + a.log_prob_share if shape.log_prob_recompute else 1
    step = (shape.batch * shape.group * mean / rollout_rate + tail
            + shape.batch * shape.group * mean / train_rate * forward + pick["step_fixed_s"])  # fmt: skip
    validation = shape.held_out * mean / rollout_rate + tail
    writes = shape.saves * shape.checkpoint_bytes / (pick["write_gb_s"] * 1e9)
    return shape.steps * step + shape.validations * validation + writes + pick["startup_s"]


def test_the_expected_cost_is_the_stated_model_and_its_range_lies_under_the_upper_bound() -> None:
    """The expected figure, the low end (every assumption at its cheap end: short responses, fast rates, short
    fixed time) and the high end (every one at its dear end) are the stated model's; the upper bound takes
    every response at the cap and every other assumption at its dear end."""
    shape = _shape()
    estimate = cost.verl_estimate(shape, 4200, 2000, {"time": 2880})
    assert estimate is not None
    s = estimate.seconds
    for end in ("expected", "low", "high"):
        assert getattr(s, end) == pytest.approx(_by_hand(shape, end)), end
    assert estimate.upper_s == pytest.approx(_by_hand(shape, "high", at_cap=True))
    assert estimate.attempts == 1 and estimate.devices == 32 and estimate.unit == "GPU"
    assert s.low < s.expected < s.high <= estimate.upper_s
    assert estimate.hours.expected == pytest.approx(s.expected * 32 / 3600)
    a = cost.ASSUMPTIONS["qwen3-4b-base"]
    assert estimate.parts["step_fixed"] == 300 * a.step_fixed_s.expected and estimate.parts["requeues"] == 0
    assert sum(estimate.parts.values()) == pytest.approx(s.expected)
    said = estimate.assumptions
    assert "not measurements" in estimate.rests_on and "mean response 33% of the cap" in said
    assert "rollout rate x 1 (0.5-1.3) and train rate x 1 (0.7-1.3)" in said and "30 s fixed a step (15-60" in said


def test_the_range_holds_the_rates_uncertainty(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the rates' factors pinned at 1, the low end is dearer and the high end cheaper than with their
    stated spread; the expected figure is the same."""
    stated = cost.verl_estimate(_shape(), 4200, 2000, {})
    one = cost.Span(1, 1, 1)
    pinned = dataclasses.replace(cost.ASSUMPTIONS["qwen3-4b-base"], rollout_rate=one, train_rate=one)
    monkeypatch.setitem(cost.ASSUMPTIONS, "qwen3-4b-base", pinned)
    fixed_rates = cost.verl_estimate(_shape(), 4200, 2000, {})
    assert stated is not None and fixed_rates is not None
    assert stated.seconds.expected == pytest.approx(fixed_rates.seconds.expected)
    assert stated.seconds.low < fixed_rates.seconds.low and stated.seconds.high > fixed_rates.seconds.high


def test_a_run_longer_than_the_time_limit_pays_a_start_up_for_every_attempt() -> None:
    one = cost.verl_estimate(_shape(), 4200, 2000, {})
    short = cost.verl_estimate(_shape(), 4200, 2000, {"time": 120})  # two hours an attempt
    assert one is not None and short is not None and one.attempts == 1
    assert short.attempts == math.ceil((one.seconds.expected - 600) / (7200 - 600)) > 1
    assert short.seconds.expected == pytest.approx(one.seconds.expected + (short.attempts - 1) * 600)
    assert cost.verl_estimate(_shape(model="qwen3-tiny"), 4200, 2000, {}) is None  # no stated assumptions


def test_a_requeue_redoes_half_a_save_interval_unless_the_run_saves_on_the_way_out() -> None:
    """Without save_grace_s a requeue loses the steps since the last checkpoint (save_freq / 2 on average) and
    the next attempt redoes them; with it the trainer checkpoints its step before the requeue, so a requeue
    costs that checkpoint's write and no step. Either way each attempt pays its start-up, and the attempts hold
    the redone work."""
    shape = _shape(save_freq=10)
    one = cost.verl_estimate(shape, 4200, 2000, {})
    redo = cost.verl_estimate(shape, 4200, 2000, {"time": 120})
    saved = cost.verl_estimate(shape, 4200, 2000, {"time": 120, "save_grace_s": 600})
    assert one is not None and redo is not None and saved is not None
    p = one.parts
    step = (p["rollout"] + p["train"] + p["step_fixed"]) / 300
    write, work = p["checkpoint_writes"] / 30, one.seconds.expected - 600
    assert redo.attempts == math.ceil((work - 5 * step) / (6600 - 5 * step)) > 1
    assert redo.seconds.expected == pytest.approx(work + (redo.attempts - 1) * 5 * step + redo.attempts * 600)
    assert redo.parts["requeues"] == pytest.approx((redo.attempts - 1) * 5 * step)
    assert saved.attempts == math.ceil((work - write) / (6600 - write)) > 1
    assert saved.seconds.expected == pytest.approx(work + (saved.attempts - 1) * write + saved.attempts * 600)
    assert saved.seconds.expected < redo.seconds.expected
    assert "a requeue redoes 5 steps on average (save_freq 10, no save_grace_s)" in redo.assumptions
    assert "a requeue saves on the way out (save_grace_s): no step redone" in saved.assumptions
    assert "requeue" not in one.assumptions  # no time limit: one attempt


def test_a_command_that_recomputes_the_old_log_probs_pays_one_more_forward_and_says_so() -> None:
    """Without algorithm.rollout_correction.bypass_mode=true VeRL recomputes the old log-probs with a forward
    over the batch each step: a third of the update's forward and backward (a quarter for 30B-A3B, whose update
    recomputes its activations), at the train rate, and the cost line says which."""
    for model, share in (("qwen3-4b-base", 1 / 3), ("qwen3-30b-a3b-base", 1 / 4)):
        plain = cost.verl_estimate(_shape(model=model), 4200, 2000, {})
        again = cost.verl_estimate(_shape(model=model, log_prob_recompute=True), 4200, 2000, {})
        assert plain is not None and again is not None
        assert again.parts["train"] == pytest.approx(plain.parts["train"] * (1 + share))
        assert again.parts["rollout"] == plain.parts["rollout"]
        assert f"old log-probs recomputed by a forward each step (+{share:.0%} of the update" in again.assumptions
        assert "old log-probs the rollout's (algorithm.rollout_correction.bypass_mode=true)" in plain.assumptions


def test_a_preflights_measured_steps_take_precedence_over_the_stated_model_and_say_so() -> None:
    """A setting its preflight measured is costed from the measured step, start-up, save and validation (they
    hold the rates, the fixed time and any recompute), the stated model's high end and upper bound kept."""
    shape, cluster = _shape(save_freq=10), {"time": 120, "save_grace_s": 600}
    stated = cost.verl_estimate(shape, 4200, 2000, cluster)
    measured = cost.StepCalibration(cost.Span(100, 90, 120), cost.Span(500, 400, 600), cost.Span(30, 25, 40),
                                    "preflight p's 3 run(s) of this setting", cost.Span(200, 180, 220))  # fmt: skip
    e = cost.measured_verl_estimate(shape, stated, measured, cluster)
    work = 300 * 100 + 31 * 200 + 30 * 30
    assert e.attempts == math.ceil((work - 30) / (7200 - 500 - 30))
    assert e.seconds.expected == pytest.approx(work + (e.attempts - 1) * 30 + e.attempts * 500)
    assert stated is not None and e.seconds.high == max(stated.seconds.high, e.seconds.expected)
    assert e.upper_s == stated.upper_s and e.rests_on == "preflight p's 3 run(s) of this setting"
    assert "take precedence over the stated rates, fixed time and recompute" in e.assumptions


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


def _paper_main(tmp_path: Path, max_concurrent: int, small_on: int | None = None, order: str = "seed",
                overrides: list[str] | None = None):  # fmt: skip
    """paper-main's plan on the staged h20 profile; `small_on`: its 4B and 8B settings on that many nodes
    (`backend.nnodes` in their settings), the 30B ones on the preset's 4; in `order` (answers: as the dry run
    orders them, by their expected cost); `overrides`: the command line's, over the sweep file's."""
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
    specs = expand(list(overrides or []), load_sweep_file(sweep))
    seconds = expected_seconds(specs, ctx, executor) if order == "answers" else None
    return ctx, executor, plan(specs, ctx, order=order, run_seconds=seconds)


# A first-principles estimate of a paper-main run, from the H20's figures and the models' shapes, not from the
# cost model or the profile's rates (docs/CLUSTER.md, "Cost", states every assumption). Each range: expected,
# then the cheap end, then the dear end.
H20_BF16, H20_FP8, H20_BYTES_S = 148e12, 296e12, 4.0e12  # dense FLOP/s; HBM3 bytes/s
GPUS, STEPS, VALIDATIONS, HELD_OUT, SAVES, ATTEMPT_S = 32, 300, 31, 60 * 16, 30, 2 * 86400
PROMPT, ATTENTION_WIDTH = 200, 32 * 128  # tokens a prompt; heads x head dim, every model
BANDWIDTH = {"expected": 0.60, "low": 0.75, "high": 0.40}  # decode's share of 4.0 TB/s
DECODE_FLOPS = {"expected": 0.50, "low": 0.65, "high": 0.30}  # decode's share of the peak
ITERATION_S = {"expected": 1.5e-3, "low": 0.5e-3, "high": 3e-3}  # scheduling, sampling, launches, all-reduces
WRITE_B_S = {"expected": 2e9, "low": 5e9, "high": 0.5e9}  # checkpoint writes (as the model states them)
_DENSE_LENGTH = {"expected": 0.33, "low": 0.2, "high": 0.6}  # mean response / cap (as the model states them)
_MOE_LENGTH = {"expected": 0.23, "low": 0.12, "high": 0.5}


def _span(expected: float, low: float, high: float) -> dict[str, float]:
    return {"expected": expected, "low": low, "high": high}


_4B = dict(active=4.0e9, layers=36, kv_heads=8, weight_bytes=4.022e9 * 2, tp=1, batch=128, group=8, cap=8192,
           length=_DENSE_LENGTH, passes=3, train_peak=H20_BF16, mfu=_span(0.35, 0.45, 0.25), decode_peak=H20_BF16,
           fixed_s=_span(30, 15, 60), startup_s=_span(600, 300, 1200), checkpoint_bytes=4.022e9 * 14)  # fmt: skip
_30B = dict(active=3.3e9, layers=48, kv_heads=4, weight_bytes=30.53e9, tp=4, batch=256, group=16, cap=16384,
            length=_MOE_LENGTH, passes=4, decode_peak=H20_FP8, fixed_s=_span(90, 45, 180),
            startup_s=_span(1200, 600, 2400), checkpoint_bytes=30.53e9 * 14)  # fmt: skip
FIRST_PRINCIPLES = {  # the dry run's setting: (the docs' label, the setting's constants)
    "verl: qwen3-4b-base bf16 on megatron": ("4B bf16", _4B),
    "verl: qwen3-8b-base bf16 on megatron": ("8B bf16", {**_4B, "active": 8.2e9, "weight_bytes": 8.19e9 * 2, "tp": 2,
                                                         "fixed_s": _span(40, 20, 80), "checkpoint_bytes": 8.19e9 * 14}),
    "verl: qwen3-30b-a3b-base fp8_e2e on megatron": ("30B-A3B fp8_e2e", {**_30B, "train_peak": H20_FP8,
                                                                         "mfu": _span(0.12, 0.16, 0.08)}),
    "verl: qwen3-30b-a3b-base fp8_rollout on megatron": ("30B-A3B fp8_rollout", {**_30B, "train_peak": H20_BF16,
                                                                                 "mfu": _span(0.20, 0.30, 0.12)}),
}  # fmt: skip


def _first_principles(c: dict, end: str = "expected", recompute: bool = False) -> dict[str, float]:
    """A run's seconds a step (rollout, training) and GPU-hours: FLOPs per token 2 x active parameters + the
    attention's 4 x layers x width x context, training 3 forwards' worth (4 with activation recompute, one more
    for an old-log-prob forward) at an MFU; decode per iteration of an engine the slower of bytes over the
    bandwidth and FLOPs over the peak, for the weights and for the attention, plus a latency; the bulk at the
    mean length with every sequence in flight, the slowest response alone to the cap."""
    mean = c["length"][end] * c["cap"]
    bandwidth, flops, latency = H20_BYTES_S * BANDWIDTH[end], DECODE_FLOPS[end], ITERATION_S[end]
    kv_bytes = 2 * c["layers"] * c["kv_heads"] * 128 * 2  # K and V, bf16, a token
    context = PROMPT + mean / 2
    weights_s = c["weight_bytes"] / c["tp"] / bandwidth

    def decode(sequences: int) -> float:
        engine = sequences / (GPUS / c["tp"])  # sequences an engine holds
        matmuls = max(weights_s, engine * 2 * c["active"] / c["tp"] / (c["decode_peak"] * flops))
        attention = max(engine * kv_bytes * context / c["tp"] / bandwidth,
                        engine * 4 * c["layers"] * ATTENTION_WIDTH * context / c["tp"] / (H20_BF16 * flops))
        return mean * (matmuls + attention + latency) + (c["cap"] - mean) * (weights_s + latency)

    trained = PROMPT + mean
    forward = 2 * c["active"] + 4 * c["layers"] * ATTENTION_WIDTH * trained / 2
    train = (c["batch"] * c["group"] * trained * (c["passes"] + recompute) * forward
             / (GPUS * c["train_peak"] * c["mfu"][end]))  # fmt: skip
    rollout, write, startup = decode(c["batch"] * c["group"]), c["checkpoint_bytes"] / WRITE_B_S[end], c["startup_s"][end]
    work = STEPS * (rollout + train + c["fixed_s"][end]) + VALIDATIONS * decode(HELD_OUT) + SAVES * write
    attempts = max(1, math.ceil((work - write) / (ATTEMPT_S - startup - write)))  # a save on the way out each requeue
    seconds = work + (attempts - 1) * write + attempts * startup
    return {"rollout": rollout, "train": train, "fixed": c["fixed_s"][end], "gpu_hours": seconds * GPUS / 3600}


@pytest.mark.parametrize("recompute", [False, True], ids=["bypass", "old-log-prob-forward"])
def test_paper_mains_expected_gpu_hours_lie_within_a_quarter_of_a_first_principles_estimate(
        tmp_path: Path, recompute: bool) -> None:  # fmt: skip
    """Each paper-main setting's expected GPU-hours a run, from the shipped h20 profile's dry run, within 25% of
    the first-principles estimate above, which lies inside the model's range; with the commands as pdmctl writes
    them (the old log-probs the rollout's) and with the old-log-prob forward of `backend.skip_old_log_prob=false`
    (no algorithm.rollout_correction.bypass_mode=true), whose cost line says so."""
    overrides = ["backend.skip_old_log_prob=false"] if recompute else []
    ctx, executor, sweep_plan = _paper_main(tmp_path, max_concurrent=4, overrides=overrides)
    data = costing.plan_json(sweep_plan, ctx, executor, "seed")
    assert [s["setting"] for s in data["settings"]] == list(FIRST_PRINCIPLES)
    for setting in data["settings"]:
        runs = [r for r in data["runs"] if r["setting"] == setting["setting"]]
        c = runs[0]["cost"]
        model = setting["cost"]["expected"] / setting["runs"]
        estimate = _first_principles(FIRST_PRINCIPLES[setting["setting"]][1], recompute=recompute)["gpu_hours"]
        assert abs(model - estimate) <= 0.25 * estimate, (setting["setting"], model, estimate)
        assert c["low"] <= estimate <= c["high"], (setting["setting"], c, estimate)
        said = "old log-probs recomputed by a forward each step" if recompute else "no recompute forward"
        assert all(said in r["cost"]["assumptions"] for r in runs), c["assumptions"]


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
    printed = re.match(r"sweep cost: 48 run\(s\), ([\d,]+) GPU-hours expected \(([\d,]+)-([\d,]+); high: every stated "
                       r"assumption at its dear end\), at the length cap ([\d,]+) \(every response at its cap", line)  # fmt: skip
    assert printed is not None, line
    for figure, key in zip(printed.groups(), ("expected", "low", "high", "upper_bound"), strict=True):
        assert float(figure.replace(",", "")) == pytest.approx(sweep[key], rel=1e-3), key
    assert "on the profile's 4 node(s) at max_concurrent 1" in line and "not measurements" in line
    # each end of a range named by what it takes: the high end's values and requeues, the length cap's
    four_b = next(r["cost"] for r in runs if r["config"]["model"]["name"] == "qwen3-4b-base")
    dear = cost.ASSUMPTIONS["qwen3-4b-base"].dear_end()
    assert four_b["high_assumes"].startswith(dear + ", ") and "requeue(s)" in four_b["high_assumes"]
    assert four_b["upper_bound_assumes"].startswith("every response at its cap, the rest as at the high end")
    printed_run = next(x for x in describe_runs(sweep_plan.to_submit, ctx, executor) if x.startswith("    cost: 300 "))
    assert f"high: {four_b['high_assumes']}; at the length cap: {four_b['upper_bound_assumes']}" in printed_run
    assert "upper bound" not in " ".join(describe_runs(sweep_plan.to_submit, ctx, executor))


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
    assert first["cost"]["high_assumes"] == first["cost"]["upper_bound_assumes"] == cost.TOY_DEAR_END  # a loaded machine
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
    """docs/CLUSTER.md, "Cost", quotes the dry run of paper-main on the shipped h20 profile: a run of each setting,
    each setting's sum, the sweep's expected GPU-hours, range, upper bound and wall days on 16 nodes
    (max_concurrent 4) and on a 4-node partition (max_concurrent 1), with the 4B and 8B settings on four nodes
    and on one, the 4B and 8B first complete comparison days on 4 nodes, and the cross-check table: the model's
    figures a run and a step beside the first-principles estimate's."""
    doc = (ROOT / "docs" / "CLUSTER.md").read_text()
    section = " ".join(doc[doc.index("### Cost"):doc.index("### Network settings")].split())

    def quoted(text: str) -> None:
        assert " ".join(text.split()) in section, text

    run_line = re.compile(r"([\d,]+) GPU-hours a run expected \(([\d,]+)-([\d,]+)\), at the length cap ([\d,]+); (.+?) a "
                          r"run expected")  # fmt: skip
    setting_line = re.compile(r"  setting cost: 12 run\(s\), ([\d,]+) GPU-hours expected .*?\((\d+) attempt\(s\)")
    per_setting: dict[tuple[int, int | None], list[str]] = {}
    for slots, small_on in ((4, None), (1, None), (4, 1), (1, 1)):
        ctx, executor, sweep_plan = _paper_main(tmp_path / f"{slots}-{small_on}", slots, small_on, order="answers")
        lines = describe_runs(sweep_plan.to_submit, ctx, executor)
        figures = re.match(r"sweep cost: 48 run\(s\), ([\d,]+ GPU-hours expected \([\d,]+-[\d,]+); high: every stated "
                           r"assumption at its dear end\), at the length cap ([\d,]+) \([^)]+\); ([^;]+?) of wall time "
                           r"expected \(([^;]+); at the length cap ([^)]+)\)", lines[-1])  # fmt: skip
        assert figures is not None, lines[-1]
        hours, cap, days, spread, upper = figures.groups()
        quoted(f"{hours}), at the length cap {cap}; {days} expected ({spread}; at the length cap {upper}) at "
               f"max_concurrent {slots}")  # fmt: skip
        per_setting[slots, small_on] = [m[1] for m in map(setting_line.match, lines) if m]
        runs = [m for m in (run_line.search(line) for line in lines if line.startswith("    cost: ")) if m]
        if (slots, small_on) == (4, None):
            four, eight, e2e, rollout = runs
            for label, m in (("4B", four), ("8B", eight), ("each 30B setting", e2e)):
                quoted(f"{label}: {m[1]} GPU-hours a run expected ({m[2]}-{m[3]}), at the length cap {m[4]}; {m[5]} a run")
            attempts = [m[2] for m in map(setting_line.match, lines) if m]
            quoted(f"{m[5]} a run, {attempts[2]} attempts of the profile's 2 days")
            data = costing.plan_json(sweep_plan, ctx, executor, "answers")
            model = {s["setting"]: next(r["cost"] for r in data["runs"] if r["setting"] == s["setting"])
                     for s in data["settings"]}  # fmt: skip
            printed = dict(zip(FIRST_PRINCIPLES, (four, eight, e2e, rollout), strict=True))
        if (slots, small_on) == (4, 1):
            quoted(f"a 4B run takes {runs[0][5]} on its 8 GPUs")
        if (slots, small_on) == (1, None):
            days = costing.first_answers(sweep_plan, ctx, executor)
            four_b, eight_b = (days[f"verl: qwen3-{m}-base bf16 on megatron"] for m in ("4b", "8b"))
            quoted(f"the 4B comparison is in on day {four_b.expected:.1f} ({four_b.low:.1f}-{four_b.high:.1f}) and the "
                   f"8B on day {eight_b.expected:.1f} ({eight_b.low:.1f}-{eight_b.high:.1f})")  # fmt: skip
    whole, packed = per_setting[4, None], per_setting[4, 1]
    quoted(f"per setting of 12 runs {whole[0]} GPU-hours expected (4B), {whole[1]} (8B) and {whole[2]} (each 30B)")

    def value(figure: str) -> float:
        return float(figure.replace(",", ""))

    sweep = sum(map(value, whole))
    quoted(f"The 30B runs hold {(value(whole[2]) + value(whole[3])) / sweep:.0%} of the hours (2 x {whole[2]} of "
           f"{sweep:,.0f})")  # fmt: skip
    small = (value(packed[0]) + value(packed[1])) / (value(whole[0]) + value(whole[1]))
    quoted(f"the 4B and 8B runs cost {1 - small:.0%} fewer GPU-hours ({packed[0]} + {packed[1]} for their settings on "
           f"one node against {whole[0]} + {whole[1]} on four)")  # fmt: skip
    for setting, (label, constants) in FIRST_PRINCIPLES.items():
        ours = _first_principles(constants)
        low, high = (_first_principles(constants, end)["gpu_hours"] for end in ("low", "high"))
        c, m = model[setting], printed[setting]
        step = [c["parts_s"][part] / 300 for part in ("rollout", "train", "step_fixed")]
        quoted(f"| {label} | {ours['rollout']:.1f} s | {ours['train']:.1f} s | {ours['fixed']:g} s | "
               f"{ours['gpu_hours']:,.0f} ({low:,.0f}-{high:,.0f}) | {m[1]} ({m[2]}-{m[3]}); a step {step[0]:.1f} + "
               f"{step[1]:.1f} + {step[2]:g} s | {c['expected'] / ours['gpu_hours']:.2f} |")  # fmt: skip
    again = [_first_principles(constants, recompute=True)["gpu_hours"] for _, constants in FIRST_PRINCIPLES.values()]
    quoted("principles give {:,.0f}, {:,.0f}, {:,.0f} and {:,.0f} GPU-hours a run".format(*again))


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


def test_the_analysis_docs_one_gpu_command_costs_what_its_dry_run_prints(tmp_path: Path) -> None:
    """docs/ANALYSIS.md's Qwen3-0.6B command on clusters/one-gpu.yaml (its weights and data staged, planned
    without SLURM): the hours a run, the 61 runs' hours and the minutes a run the doc states are the dry run's."""
    from pdmctl.backends.verl.data import prepare_data

    stage_model(tmp_path / "models" / "Qwen3-0.6B-Base", "qwen3-0.6b-base")
    source = tmp_path / "problems.jsonl"
    source.write_text("".join(json.dumps({"problem": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n" for i in range(8)))
    prepare_data(tmp_path / "data", str(source), str(source), str(source))
    fields = yaml.safe_load((ROOT / "clusters" / "one-gpu.yaml").read_text().replace("CHANGE-ME", "site"))
    fields.update(models_dir=str(tmp_path / "models"), data_dir=str(tmp_path / "data"))
    (tmp_path / "one-gpu.yaml").write_text(yaml.safe_dump(fields))
    doc = " ".join((ROOT / "docs" / "ANALYSIS.md").read_text().split())
    command = re.search(r"(PDMCTL_VERL_SNAPSHOT_STEP=1 pdmctl sweep backend=verl model=qwen3-0\.6b-base .*?) --cluster one-gpu",
                        doc.replace("\\ ", ""))  # fmt: skip
    assert command, "the doc's command"
    env, args = command.group(1).split(" pdmctl ", 1)
    result = pdmctl(*[a.strip('"') for a in args.split()], "--cluster", str(tmp_path / "one-gpu.yaml"), "--dry-run",
                    "--offline", cwd=tmp_path, env=dict([env.split("=", 1)]))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    text = " ".join(result.stdout.split())
    run = re.search(r"on 1 GPUs: ([\d.]+) GPU-hours a run expected \(([\d.]+)-([\d.]+)\), at the length cap ([\d.]+); "
                    r"([\d.]+) min a run", text)  # fmt: skip
    total = re.search(r"sweep cost: 61 run\(s\), ([\d.]+) GPU-hours expected \(([\d.]+)-([\d.]+);", text)
    assert run and total, text[-3000:]
    stated = (f"{run.group(1)} GPU-hours a run expected ({run.group(2)}-{run.group(3)}; {run.group(4)} at the length "
              f"cap), {run.group(5)} min a run, {total.group(1)} GPU-hours for the 61 runs ({total.group(2)}-"
              f"{total.group(3)};")  # fmt: skip
    assert stated in doc, stated
