"""What an instrument reads off the testbed: a rollout batch made stale as in training, and D, Ḋ and r
of its tokens at the learner's weights (the direction analysis, `pdmctl.analysis`, and `tails.py`)."""

from __future__ import annotations

import dataclasses

import torch

from pdmctl import masks
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import PRECISIONS, forward
from pdmctl.backends.toy.rollout import Rollout
from pdmctl.backends.toy.trainer import Learner, grpo_advantages


def stale_batch(cfg: ToyConfig, *, stale: bool = True) -> tuple[Learner, Rollout, torch.Tensor]:
    """A fresh rollout batch from the base model and its advantages, with the learner moved on by all
    mini-batch updates of the step but the last: the staleness of a step's last mini-batch. With
    `stale` False the learner stays at the rollout's weights (no update, a fresh Adam): the fresh
    rollout, where D comes from the rollout weights' precision alone."""
    learner = Learner.from_base(cfg)
    problems = learner.task.sample_train(cfg.prompts_per_step, learner.generator).repeat(cfg.group_size)
    batch = learner.rollout(problems)
    advantages = grpo_advantages(learner.task.score(problems, batch.sampled_ids), cfg.group_size)
    order = torch.randperm(len(problems), generator=learner.generator)
    for rows in order.tensor_split(cfg.minibatches)[:-1] if stale else ():
        learner.update(batch.select(rows), advantages[rows], cfg)
    return learner, batch, advantages


def diagnostics(
    learner: Learner, batch: Rollout, advantages: torch.Tensor, cfg: ToyConfig, estimator: str
) -> masks.Diagnostics:
    """D, Ḋ and r of every generated token ([B, T] each) at the learner's current weights."""
    with torch.no_grad():
        logits = forward(
            learner.policy, batch.tokens[:, :-1], batch.sampled_ids.shape[1], PRECISIONS[cfg.precision].train
        )
    shape = batch.sampled_ids.shape
    d = flat_diagnostics(logits, batch, advantages, cfg, method="pdm", estimator=estimator)
    return dataclasses.replace(d, **{f.name: getattr(d, f.name).view(shape) for f in dataclasses.fields(d)})


def flat_diagnostics(
    logits: torch.Tensor,
    batch: Rollout,
    advantages: torch.Tensor,
    cfg: ToyConfig,
    *,
    method: str,
    estimator: str,
) -> masks.Diagnostics:
    """`masks.token_diagnostics` of every generated token of `batch` ([B*T] each) under `cfg`'s δ and
    divergence, with `method` and `estimator` as given."""
    return masks.token_diagnostics(
        logits.reshape(-1, logits.shape[-1]),
        batch.sampled_ids.reshape(-1),
        batch.topk_ids.reshape(-1, batch.topk_ids.shape[-1]),
        batch.topk_logprobs.reshape(-1, batch.topk_ids.shape[-1]),
        batch.sampled_logprobs.reshape(-1),
        advantages.unsqueeze(1).expand(batch.sampled_ids.shape).reshape(-1),
        method=method,
        divergence=cfg.divergence,
        estimator=estimator,
        delta=cfg.delta,
        delta_low=cfg.delta_low,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        ratio_cap=cfg.ratio_cap,  # GRPO's mask: its dual clip, so M is where its gradient is
    )
