"""The fork preset (`model=toy-fork`): toy-llm's task with phrasing slots that fork
three or more ways, and a sharper model whose fp8 rollout weights move tokens out of the trust region.

The thresholds hold on the shipped base (docs/TESTBED.md, "The fork preset", has what each kernel
setting measured). Each test takes a few seconds on one core.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pdmctl.analysis.bands import topk_mass
from pdmctl.backends.base import InMemoryTracker
from pdmctl.backends.toy import ToyConfig, basemodel, fork_task, train
from pdmctl.backends.toy.model import MODEL_PRESETS, PRECISIONS, TinyTransformer, build_model
from pdmctl.backends.toy.probe import diagnostics, stale_batch
from pdmctl.backends.toy.rollout import RolloutEngine
from pdmctl.backends.toy.tasks import task_of


@pytest.fixture(scope="module")
def rollout():
    """512 sampled responses of the base to training prompts, from the bf16 rollout weights."""
    base = basemodel.load_base_model("toy-fork")
    task = task_of("toy-fork")
    engine = RolloutEngine(base, PRECISIONS["bf16"].rollout, 20, task.max_response_len, task.kv_cache)
    engine.sync(base)
    generator = torch.Generator().manual_seed(7)
    problems = task.sample_train(512, generator)
    return problems, engine.generate(problems.prompts, generator)


def test_the_shipped_file_is_small_and_recorded() -> None:
    path = basemodel.shipped_path("toy-fork")
    assert path.stat().st_size <= 2 * 2**20
    assert basemodel.sha256_of(path) == basemodel.SHIPPED_SHA256["toy-fork"]
    entry = torch.load(path, weights_only=True)
    assert entry["recipe"] == basemodel.recipe_of("toy-fork")
    assert entry["built_with"]["criterion_step"] <= MODEL_PRESETS["toy-fork"].warmup_steps * 0.6


def test_the_slot_law_has_three_or_more_plausible_options() -> None:
    prompts = task_of("toy-fork").sample_train(64, torch.Generator().manual_seed(0)).prompts
    law = fork_task.slot_law(prompts)
    torch.testing.assert_close(law.sum(-1), torch.ones(64, fork_task.SLOTS))
    assert ((law >= 0.1).sum(-1) >= 4).all()
    assert (
        len(set(law.argmax(-1).flatten().tolist())) == fork_task.SLOT_OPTIONS
    )  # each option likeliest somewhere


def test_the_base_has_many_way_forks_and_near_deterministic_tokens(rollout) -> None:
    problems, batch = rollout
    task = task_of("toy-fork")
    response = task.response_mask(batch.sampled_ids).bool()
    mass = topk_mass(batch.topk_logprobs)[response]
    assert (mass >= 0.994).float().mean() > 0.85  # most positions: an LLM's near-deterministic tokens
    long = task.response_lengths(batch.sampled_ids) == fork_task.LONG_LEN
    assert long.float().mean() > 0.35
    slots = batch.topk_logprobs[long][:, list(fork_task.SLOT_POSITIONS)].exp()  # [N, SLOTS, K]
    plausible = (slots >= 0.05).sum(-1)
    assert (plausible >= 3).float().mean() > 0.8  # three or more plausible continuations at most slots
    assert 0.3 < task.score(problems, batch.sampled_ids).mean() < 0.85  # room for RL to gain


def test_fp8_rollout_weights_alone_move_fork_tokens_out_of_the_region() -> None:
    """The mismatch-only setting (no stale update): D from the fp8 rollout weights alone exceeds δ on
    some tokens, and there the ratio and the predictive criterion disagree on some."""
    cfg = ToyConfig(model="toy-fork", precision="fp8_rollout", prompts_per_step=64, group_size=8, seed=1000)
    learner, batch, advantages = stale_batch(cfg, stale=False)
    d = diagnostics(learner, batch, advantages, cfg, "exact")
    response = learner.task.response_mask(batch.sampled_ids).bool()
    outside = d.out_of_region & response
    assert outside.sum() > 0.03 * response.sum()
    ratio_keep = advantages.unsqueeze(1) * (d.ratio - 1) <= 0
    predictive_keep = advantages.unsqueeze(1) * d.ddot <= 0
    assert (outside & (ratio_keep != predictive_keep)).sum() >= 5


def test_the_other_presets_compute_as_before() -> None:
    """ForkPreset's knobs are off elsewhere: no logit multiplier, no init scaling (their shipped weights and
    results stay bit-identical; tests/test_toy_llm.py and tests/test_toy_model.py hold the digests)."""
    for name in ("toy-small", "toy-llm"):
        assert TinyTransformer(MODEL_PRESETS[name]).logit_scale is None
        torch.manual_seed(0)
        plain = TinyTransformer(MODEL_PRESETS[name])
        built = build_model(MODEL_PRESETS[name], 0)
        for a, b in zip(plain.state_dict().values(), built.state_dict().values(), strict=True):
            assert torch.equal(a, b)
    fork = build_model(MODEL_PRESETS["toy-fork"], 0)
    assert fork.logit_scale == MODEL_PRESETS["toy-fork"].logit_scale


def test_a_short_run_trains_and_evaluates(tmp_path: Path) -> None:
    cfg = ToyConfig(model="toy-fork", prompts_per_step=16, group_size=4, minibatches=2, steps=2, eval_every=2,
                    checkpoint_every=2, eval_samples=2, precision="fp8_rollout")  # fmt: skip
    tracker = InMemoryTracker()
    train(cfg, tmp_path, tracker)
    assert [step for step, _ in tracker.history("train/response_length")] == [1, 2]
    assert all(math.isfinite(v) for _, v in tracker.history("train/entropy"))
