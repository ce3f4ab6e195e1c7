"""The declared collapse rule (stop.collapse, pdmctl.budget.collapse): it is part of the run config and key only
when declared, a bad rule is refused in one line, and a run it ends is stopped, not failed: final for
`status` and `resume`, and counted in the report at its last evaluation."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdmctl.backends.base import InMemoryTracker
from pdmctl.budget.collapse import Collapsed, CollapseRule, RuleTracker
from pdmctl.grid import expand
from pdmctl.spec import run_key
from tests.test_bad_input import refused, store  # noqa: F401 (a fixture)

SYN = ["backend=synthetic", "model=synthetic"]
RULE = ["stop.collapse.reward_below=0.01", "stop.collapse.eval_below=0.02", "stop.collapse.evaluations=2"]


def test_without_a_rule_the_key_is_the_key_of_a_config_without_the_field() -> None:
    (spec,) = expand(SYN)
    assert spec.config["stop"] == {"collapse": {"reward_below": None, "eval_below": None, "evaluations": None}}
    before = {name: value for name, value in spec.config.items() if name != "stop"}
    assert spec.key == run_key(before)
    (ruled,) = expand([*SYN, *RULE])
    assert ruled.key != spec.key  # a declared rule is part of what the run is


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("stop.collapse.reward_below=-0.1", "stop.collapse.reward_below: must be a finite number >= 0, got -0.1"),
        ("stop.collapse.eval_below=nan", "stop.collapse.eval_below: must be a finite number, got nan"),
        ("stop.collapse.eval_below=2", "stop.collapse.eval_below: avg@16 is a fraction, must be <= 1, got 2"),
        ("stop.collapse.evaluations=0", "stop.collapse.evaluations: must be an integer >= 1, got 0"),
        ("+stop.collapse.patience=3", "stop.collapse: unknown key(s) patience; its keys are reward_below"),
    ],
)
def test_a_bad_rule_is_one_line_exit_2_nothing_written(store: Path, override: str, needle: str) -> None:  # noqa: F811
    key = override.lstrip("+").split("=")[0]
    rest = [r for r in RULE if not r.startswith(key)]
    refused(store, ["sweep", *SYN, *rest, override], needle)


def test_a_rule_with_a_field_missing_is_refused(store: Path) -> None:  # noqa: F811
    refused(store, ["sweep", *SYN, RULE[0]], "stop.collapse: eval_below, evaluations not set")


def test_the_rule_counts_evaluations_in_a_row_after_training() -> None:
    """Step 0 (no training before it) is no evidence; a good evaluation resets the count; the N-th collapsed
    evaluation in a row raises with the step, the reward and the best avg@16 in its reason."""
    tracker = RuleTracker(InMemoryTracker(), CollapseRule(0.01, 0.02, 2))
    tracker.log_metrics({"eval/a": 0.0, "eval/b": 0.0}, 0)
    for step, score in ((1, 0.0), (2, 0.5), (3, 0.0)):
        tracker.log_metrics({"train/reward": 0.0}, step)
        tracker.log_metrics({"eval/a": score, "eval/b": 0.0}, step)
    tracker.log_metrics({"train/reward": 0.0}, 4)
    with pytest.raises(Collapsed, match=r"^stopped by the collapse rule at step 4: reward 0\.00, avg@16 1\.0% "
                                        r"for 2 evaluations$"):  # fmt: skip
        tracker.log_metrics({"eval/a": 0.01, "eval/b": 0.0}, 4)
    assert tracker.inner.history("eval/a")[-1] == (4, 0.01)  # logged before the check


def test_a_collapsed_run_is_stopped_shown_kept_by_resume_and_reported(workdir: Path) -> None:
    """Two synthetic runs under one rule: δ=0.9 scores ~0 throughout and is stopped at its second evaluation
    after training (step 2 of 4); δ=0.12 never meets the rule and finishes as it would without one."""
    from pdmctl.cli import app
    from pdmctl.ledger import open_ledger
    from tests.conftest import pdmctl, sqlite_uri

    res = pdmctl("sweep", *SYN, *RULE, "delta=0.12,0.9", "--name", "rule", "--wait", cwd=workdir, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = {r.spec.config["delta"]: r for r in open_ledger(sqlite_uri(workdir)).runs("rule")}  # type: ignore[union-attr]
    stopped, kept = runs[0.9], runs[0.12]
    assert (stopped.status, stopped.step) == ("KILLED", 2), stopped
    assert stopped.reason.startswith("stopped by the collapse rule at step 2: reward 0.00, avg@16 0.0% for 2 ")
    assert (kept.status, kept.step, kept.reason) == ("FINISHED", 4, None), kept
    wide = CliRunner()
    shown = wide.invoke(app, ["status", "rule"])
    assert shown.exit_code == 0 and "stopped (stopped by the collapse rule" in shown.output, shown.output
    resumed = wide.invoke(app, ["resume", "rule"])
    assert resumed.exit_code == 0 and "0 run(s) resubmitted" in resumed.output, resumed.output
    report = wide.invoke(app, ["report", "rule", "--out", str(workdir / "out")])
    assert report.exit_code == 0, report.output
    text = " ".join(" ".join(p.read_text() for p in (workdir / "out").rglob("*.md")).split())
    assert "seed 0 stopped: collapse at step 2 (avg@16 0.0%)" in text, text
    assert "it stopped 1 run(s)" in text and "not finished" not in text, text


def test_verl_printed_lines_give_the_rule_its_reward_and_evaluations() -> None:
    """VeRL 0.9.1's own console lines (tests/data): a training step gives train/reward (critic/score/mean),
    step 0's validation its held-out sets; the job's tracker checks the rule on them."""
    from pdmctl.backends.verl import metrics

    data = Path(__file__).parent / "data"
    training = metrics.step_metrics_from_line((data / "verl_step1_training_line.txt").read_text())
    validation = metrics.step_metrics_from_line((data / "verl_step0_validation_line.txt").read_text())
    assert training == (1, {"train/reward": -0.25})
    assert validation is not None and validation[0] == 0 and set(validation[1]) >= {"eval/aime24", "eval/aime25"}
    assert metrics.step_metrics_from_line("step:3 - actor/loss:0.1") is None
