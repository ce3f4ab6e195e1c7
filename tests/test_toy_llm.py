"""The LLM-like preset (`model=toy-llm`), the top-K-mass bands of the analysis, and the entropy and
top-K mass the trainer logs.

The thresholds hold on the shipped base and on a base rebuilt under the scalar, AVX2 and AVX-512
kernels (docs/TESTBED.md, "The LLM-like preset", has what each measured).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from pdmctl.analysis.bands import BANDS, BandCounter, band_analysis, topk_mass
from pdmctl.backends.base import InMemoryTracker
from pdmctl.backends.toy import ToyConfig, basemodel, llm_task, train
from pdmctl.backends.toy.model import MODEL_PRESETS, PRECISIONS
from pdmctl.backends.toy.rollout import RolloutEngine
from pdmctl.backends.toy.tasks import task_of

LLM = ToyConfig(model="toy-llm")
TINY = ToyConfig(model="toy-llm", prompts_per_step=16, group_size=4, minibatches=2, steps=3, eval_every=3,
                 checkpoint_every=3, eval_samples=2)  # fmt: skip


@pytest.fixture(scope="module")
def base():
    return basemodel.load_base_model("toy-llm")


@pytest.fixture(scope="module")
def rollout(base):
    """512 sampled responses of the base to training prompts, from the bf16 rollout weights."""
    task = task_of("toy-llm")
    engine = RolloutEngine(base, PRECISIONS["bf16"].rollout, 20, task.max_response_len, task.kv_cache)
    engine.sync(base)
    generator = torch.Generator().manual_seed(7)
    problems = task.sample_train(512, generator)
    return problems, engine.generate(problems.prompts, generator)


def test_the_base_lands_in_its_band(rollout) -> None:
    problems, batch = rollout
    task = task_of("toy-llm")
    response = task.response_mask(batch.sampled_ids).bool()
    mass = topk_mass(batch.topk_logprobs)[response]
    assert (mass >= 0.994).float().mean() > 0.85  # most positions: an LLM's near-deterministic tokens
    forking = (mass < 0.9).float().mean()
    assert 0.02 < forking < 0.12  # a few percent with a long tail (the word: top-20 ≈ 0.48)
    lengths = task.response_lengths(batch.sampled_ids).float()
    assert lengths.mean() >= 10  # tens of tokens, both forms sampled: the length can move
    assert 0.35 < (lengths == llm_task.LONG_LEN).float().mean() < 0.85
    assert 0.35 < task.score(problems, batch.sampled_ids).mean() < 0.8  # room for RL to gain


def test_the_kv_cache_gives_the_recomputed_distributions(base) -> None:
    task = task_of("toy-llm")
    generator = torch.Generator().manual_seed(3)
    prompts = task.sample_train(64, generator).prompts
    plain = RolloutEngine(base, PRECISIONS["bf16"].rollout, 20, task.max_response_len, kv_cache=False)
    cached = RolloutEngine(base, PRECISIONS["bf16"].rollout, 20, task.max_response_len, kv_cache=True)
    plain.sync(base)
    cached.sync(base)
    a = plain.generate(prompts, torch.Generator().manual_seed(0))
    b = cached.generate(prompts, torch.Generator().manual_seed(0))
    assert torch.equal(a.sampled_ids, b.sampled_ids)
    torch.testing.assert_close(a.topk_logprobs, b.topk_logprobs, atol=1e-4, rtol=1e-4)


def test_the_shipped_file_is_small_and_recorded() -> None:
    path = basemodel.shipped_path("toy-llm")
    assert path.stat().st_size <= 2 * 2**20
    assert basemodel.sha256_of(path) == basemodel.SHIPPED_SHA256["toy-llm"]
    entry = torch.load(path, weights_only=True)
    assert entry["recipe"] == basemodel.recipe_of("toy-llm")
    assert entry["built_with"]["criterion_step"] <= MODEL_PRESETS["toy-llm"].warmup_steps / 2


def test_bands_count_every_token_once() -> None:
    generator = torch.Generator().manual_seed(0)
    mass = torch.cat(
        [torch.rand(200, 6, generator=generator), torch.tensor([[0.9, 0.99, 0.994, 1.0, 0.0, 0.5]])]
    )
    response = torch.rand(mass.shape, generator=generator) < 0.8
    response[-1] = True
    ddot = {e: torch.randn(mass.shape, generator=generator) for e in ("agg", "uni", "exact")}
    counter = BandCounter.empty()
    counter.add(
        mass, response, torch.rand(mass.shape, generator=generator) < 0.3, ddot, torch.rand(mass.shape) * 2
    )
    stats = counter.stats()
    assert [s.band for s in stats] == [label for *_, label in BANDS]
    assert sum(s.tokens for s in stats) == int(response.sum())
    assert math.isclose(sum(s.share for s in stats), 1.0)
    assert [s.tokens for s in counter.stats()] == [
        int(((mass >= lo) & (mass < hi) & response).sum()) for lo, hi, _ in BANDS
    ]


def test_agg_and_uni_agree_where_the_tail_is_small_and_not_at_the_fork() -> None:
    stats = band_analysis(dataclasses.replace(LLM, prompts_per_step=64), [1000])
    assert math.isclose(sum(s.share for s in stats), 1.0)
    by = {s.band: s for s in stats}
    top, fork = by["≥ 0.994"], by["< 0.9"]
    assert top.share > 0.85 and top.out_of_region > 0
    for direction in ("agg", "uni"):  # the paper's premise, where an LLM's tokens mostly are
        assert top.agree_all[direction] > 0.95, direction
        assert top.agree_out_of_region[direction] > 0.9, direction
    assert fork.agree_all["uni"] > fork.agree_all["agg"] + 0.2  # the tail as one token misleads at the fork


def test_the_trainer_logs_entropy_top_k_mass_and_length(tmp_path: Path) -> None:
    tracker = InMemoryTracker()
    train(TINY, tmp_path, tracker)
    for name in ("entropy", "topk_mass", "response_length"):
        history = tracker.history(f"train/{name}")
        assert [step for step, _ in history] == [1, 2, 3], name
        assert all(math.isfinite(v) and v > 0 for _, v in history), name
    assert all(0.9 < v <= 1.0 + 1e-6 for _, v in tracker.history("train/topk_mass"))
    assert all(5 <= v <= llm_task.LONG_LEN for _, v in tracker.history("train/response_length"))
