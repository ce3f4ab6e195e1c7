"""How the update that ΔD measures is taken (`PROTOCOLS`), every criterion's from the same weights and
optimizer state (`snapshot`, `restore`): each criterion's gradient, then a real update (`carried`,
`fresh-adam`, `sgd`) or, for the first-order protocols, only the gradient (MATH.md)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import PRECISIONS, forward
from pdmctl.backends.toy.rollout import Rollout
from pdmctl.backends.toy.trainer import Learner, masked_loss

PROTOCOLS = {  # how the update that ΔD measures is taken, from the same weights
    "counterfactual": "the decision in one real update: per token, one Adam update on the whole batch after the "
    "step's first mini-batch updates (the carried state, each member clipped by its own gradient norm) with it "
    "kept against one with it masked, from the same start; ΔD = D(keep) − D(mask) (counterfactual.py)",
    "carried": "Adam with the state the stale mini-batch updates left (the step training takes next)",
    "fresh-adam": "a fresh Adam: the first step of a run, no momentum",
    "sgd": "the plain (clipped) gradient, no preconditioning, scaled to the fresh Adam step's length",
    "own-adam": "first order, the token's own gradient alone through the carried Adam step's gain",
    "own-grad": "first order, the token's own gradient alone as a plain gradient step",
}
UPDATE_PROTOCOLS = ("carried", "fresh-adam", "sgd")  # the protocols that take a real update
DEFAULT_PROTOCOLS = ("counterfactual", "carried", "fresh-adam", "sgd", "own-adam", "own-grad")  # the first: main table


@dataclass(frozen=True)
class CriterionGradient:
    """One criterion's update direction at the start weights: the clipped gradient (per parameter) and
    the update's metrics (Learner.update's, with `grad_norm` before clipping)."""

    grads: list[torch.Tensor]
    metrics: dict[str, float]


def criterion_gradients(
    learner: Learner, batch: Rollout, advantages: torch.Tensor, criteria: dict[str, ToyConfig]
) -> dict[str, CriterionGradient]:
    """Each criterion's clipped gradient at the learner's current weights, as `Learner.update` computes it
    (the same forward, masks.policy_loss, backward and clipping, bit for bit), from one forward shared by
    the criteria: a criterion changes the loss's mask, not the logits. The weights are left as they were;
    the parameters' `.grad` holds the last criterion's gradient."""
    params = list(learner.policy.parameters())
    resp_mask = learner.task.response_mask(batch.sampled_ids)
    any_cfg = next(iter(criteria.values()))
    logits = forward(
        learner.policy, batch.tokens[:, :-1], learner.task.max_response_len, PRECISIONS[any_cfg.precision].train
    )
    found = {}
    names = list(criteria)
    for i, (name, cfg) in enumerate(criteria.items()):
        if cfg.precision != any_cfg.precision:
            raise ValueError("criterion_gradients: the criteria share one precision (one forward)")
        loss, metrics = masked_loss(logits, batch, advantages, resp_mask, cfg)
        learner.optimizer.zero_grad()
        loss.backward(retain_graph=i < len(names) - 1)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        found[name] = CriterionGradient(
            [p.grad.detach().clone() for p in params], {**metrics, "grad_norm": float(norm)}
        )
    return found


def apply_update(
    learner: Learner, start: Snapshot, gradient: CriterionGradient, criterion: ToyConfig, protocol: str
) -> dict[str, float]:
    """One update along `gradient` (criterion_gradients's, taken at `start`'s weights) from `start`, as
    `protocol` says; the gradient's metrics. The parameters' `.grad` holds the clipped gradient after."""
    params = list(learner.policy.parameters())

    def step(optimizer: torch.optim.Optimizer) -> None:
        for p, g in zip(params, gradient.grads, strict=True):
            p.grad = g.clone()
        optimizer.step()

    restore(learner, start)
    if protocol == "carried":
        step(learner.optimizer)
        return gradient.metrics
    step(torch.optim.Adam(params, lr=criterion.lr))
    if protocol == "fresh-adam":
        return gradient.metrics
    if protocol != "sgd":
        raise ValueError(f"protocol: {protocol!r} takes no update; choose from {UPDATE_PROTOCOLS}")
    # sgd: the clipped gradient itself (an SGD step of lr 1), rescaled to the fresh Adam step's length
    theta_adam = torch.nn.utils.parameters_to_vector(params).detach()
    restore(learner, start)
    theta = torch.nn.utils.parameters_to_vector(params).detach()
    step(torch.optim.SGD(params, lr=1.0))
    with torch.no_grad():
        delta = torch.nn.utils.parameters_to_vector(params) - theta
        norm = torch.linalg.vector_norm(delta)
        scale = torch.linalg.vector_norm(theta_adam - theta) / norm if norm > 0 else torch.ones(())
        torch.nn.utils.vector_to_parameters(theta + delta * scale, params)
    return gradient.metrics


def take_update(
    learner: Learner,
    start: Snapshot,
    batch: Rollout,
    advantages: torch.Tensor,
    criterion: ToyConfig,
    protocol: str,
) -> dict[str, float]:
    """One update with `criterion`'s mask on the whole batch from `start`, taken as `protocol` says; the
    metrics of the update that was kept (Learner.update's)."""
    restore(learner, start)
    gradient = criterion_gradients(learner, batch, advantages, {"criterion": criterion})["criterion"]
    return apply_update(learner, start, gradient, criterion, protocol)


def take_update_reference(
    learner: Learner,
    start: Snapshot,
    batch: Rollout,
    advantages: torch.Tensor,
    criterion: ToyConfig,
    protocol: str,
) -> dict[str, float]:
    """`take_update` the direct way, kept as its reference (`run_analysis(reference=True)`): a whole
    Learner.update (forward, loss, backward, step) per criterion and protocol."""
    restore(learner, start)
    if protocol == "carried":
        return learner.update(batch, advantages, criterion)
    params = list(learner.policy.parameters())
    fresh = dataclasses.replace(learner, optimizer=torch.optim.Adam(params, lr=criterion.lr))
    metrics = fresh.update(batch, advantages, criterion)
    if protocol == "fresh-adam":
        return metrics
    # sgd: the clipped gradient itself (an SGD step of lr 1), rescaled to the fresh Adam step's length
    theta_adam = torch.nn.utils.parameters_to_vector(params).detach()
    restore(learner, start)
    theta = torch.nn.utils.parameters_to_vector(params).detach()
    metrics = dataclasses.replace(learner, optimizer=torch.optim.SGD(params, lr=1.0)).update(
        batch, advantages, criterion
    )
    with torch.no_grad():
        step = torch.nn.utils.parameters_to_vector(params) - theta
        norm = torch.linalg.vector_norm(step)
        scale = torch.linalg.vector_norm(theta_adam - theta) / norm if norm > 0 else torch.ones(())
        torch.nn.utils.vector_to_parameters(theta + step * scale, params)
    return metrics


@dataclass(frozen=True)
class Snapshot:
    """The weights and the optimizer state every criterion's update starts from."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, object]


def snapshot(learner: Learner) -> Snapshot:
    return Snapshot(copy.deepcopy(learner.policy.state_dict()), copy.deepcopy(learner.optimizer.state_dict()))


def restore(learner: Learner, start: Snapshot) -> None:
    """Put the learner back to `start`, bit for bit, leaving `start` as it was.

    `Module.load_state_dict` copies into the parameters, but `Optimizer.load_state_dict` keeps the
    tensors it is given (same dtype and device) and Adam then updates them in place: restoring
    `start.optimizer` itself would let every update move the snapshot on (the ratio update
    started at Adam step 7, the next criterion at step 8 with the ratio update in its momentum). So
    the optimizer gets a copy of the snapshot at each use."""
    learner.policy.load_state_dict(start.weights)
    learner.optimizer.load_state_dict(copy.deepcopy(start.optimizer))
