"""The RL loop of the CPU testbed: determinism, exact resumption, checkpoints, and that it learns."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pdmctl.backends.base import InMemoryTracker
from pdmctl.backends.toy import ToyConfig, train

TINY = ToyConfig(prompts_per_step=16, group_size=4, minibatches=2, steps=6, eval_every=2, checkpoint_every=2,
                 eval_samples=2)  # fmt: skip


def _run(cfg: ToyConfig, workdir: Path, stop_after: int | None = None) -> InMemoryTracker:
    tracker = InMemoryTracker()
    train(cfg, workdir, tracker, stop_after=stop_after)
    return tracker


def test_logs_every_metric_of_the_tracker_interface(tmp_path: Path) -> None:
    tracker = _run(TINY, tmp_path)
    for name in ("reward", "response_length", "ppo_kl", "mask_frac", "out_of_region_frac", "mean_divergence",
                 "disagreement_count", "entropy", "topk_mass", "rollout_probs_diff_mean"):  # fmt: skip
        assert [step for step, _ in tracker.history(f"train/{name}")] == list(range(1, 7))
    for dataset in ("toy24", "toy25"):
        assert [step for step, _ in tracker.history(f"eval/{dataset}")] == [0, 2, 4, 6]
        steps = [step for step, _ in tracker.per_problem[dataset]]
        assert steps == [0, 2, 4, 6]
        assert all(len(accs) == 40 for _, accs in tracker.per_problem[dataset])
        # each sample's grade and answer (pass@k, maj@k): the per-problem accuracies are their means
        for (step, accs), (same, correct, answers) in zip(tracker.per_problem[dataset], tracker.samples[dataset],
                                                          strict=True):  # fmt: skip
            assert same == step and len(correct) == len(answers) == 40
            assert all(len(c) == len(a) == 2 for c, a in zip(correct, answers, strict=True))
            assert [sum(c) / 2 for c in correct] == accs
    # the rollout/trainer gap of a bf16 rollout against the float32 trainer: small, never zero
    assert all(0 < gap < 0.05 for _, gap in tracker.history("train/rollout_probs_diff_mean"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004.pt", "step_00000006.pt"]


def test_same_seed_same_metrics_other_seed_other_metrics(tmp_path: Path) -> None:
    first = _run(TINY, tmp_path / "a").metrics
    assert _run(TINY, tmp_path / "b").metrics == first
    assert _run(dataclasses.replace(TINY, seed=1), tmp_path / "c").metrics != first


@pytest.mark.parametrize("precision", ["bf16", "fp8_e2e"])
def test_resume_gives_exactly_the_uninterrupted_metrics(tmp_path: Path, precision: str) -> None:
    cfg = dataclasses.replace(TINY, precision=precision)
    whole = _run(cfg, tmp_path / "whole").metrics
    interrupted = _run(cfg, tmp_path / "resumed", stop_after=3)  # dies after step 3, last checkpoint at 2
    assert [p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()] == ["step_00000002.pt"]
    resumed = _run(cfg, tmp_path / "resumed").metrics
    assert min(step for step, _ in resumed["train/reward"]) == 3  # picked up after the checkpoint
    for name, history in whole.items():
        assert [(s, v) for s, v in history if s > 2] == resumed[name], name
        assert [(s, v) for s, v in history if s <= 3] == interrupted.metrics[name], name


def test_resume_refuses_another_runs_checkpoint(tmp_path: Path) -> None:
    _run(TINY, tmp_path, stop_after=2)
    with pytest.raises(ValueError, match="different lr"):
        _run(dataclasses.replace(TINY, lr=0.5), tmp_path)
    longer = _run(dataclasses.replace(TINY, steps=8), tmp_path)  # more steps continue the same run
    assert [step for step, _ in longer.history("train/reward")] == [3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("method", ["grpo", "pdm"])
def test_a_short_run_raises_held_out_accuracy(tmp_path: Path, method: str) -> None:
    # 20 of the default run's 40 steps: the gain is measured on both held-out sets together (80
    # problems x 16 samples), where the base model's avg@16 has a standard error of about 0.02. At 10
    # steps the PDM run gained only 0.588 -> 0.618 on one machine under ATEN_CPU_CAPABILITY=avx2 with the
    # warm-up's base (the current code alike); at 20 it passes there, and under `default`
    cfg = ToyConfig(method=method, steps=20, eval_every=20, prompts_per_step=64)
    # Two threads, pinned: the float sums' order follows the thread count, and so does a 20-step RL run's
    # end point (at one thread the GRPO run went 0.595 -> 0.579 on this machine: RL at this lr oscillates
    # around a rise of about this size). Pinned, the run is the same computation on every machine, and CI
    # checks it under three kernel settings.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tracker = _run(cfg, tmp_path)
    finally:
        torch.set_num_threads(threads)
    (before, after) = (
        sum(tracker.history(f"eval/{name}")[i][1] for name in ("toy24", "toy25")) / 2 for i in (0, -1)
    )
    assert after >= before + 0.08, (before, after)
    rewards = [r for _, r in tracker.history("train/reward")]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3


def test_k_changes_what_the_run_learns(tmp_path: Path) -> None:
    """With a thin tail, K = 10 and K = 20 once gave the quickstart's runs identical evaluation curves (the
    tail beyond the top-10 barely existed). On the default preset, K changes the masks' decisions,
    and so the trajectory: the mask fraction and the evaluations differ (same seed, same batches)."""
    cfg = ToyConfig(steps=4, eval_every=2, checkpoint_every=4, prompts_per_step=32)
    runs = {k: _run(dataclasses.replace(cfg, k=k), tmp_path / str(k)) for k in (10, 20)}
    mask = {k: [v for _, v in r.history("train/mask_frac")] for k, r in runs.items()}
    evals = {k: [v for _, v in r.history("eval/toy24")] for k, r in runs.items()}
    assert evals[10][0] == evals[20][0]  # the same base model, evaluated alike
    assert mask[10] != mask[20] and evals[10][1:] != evals[20][1:]
