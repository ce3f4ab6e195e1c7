"""pdmctl's masks as VeRL policy losses (the `verl.plugins` entry point).

Importing this module (VeRL does it on every `import verl` through the entry
point; the job body also names it in `VERL_USE_EXTERNAL_MODULES` and
`actor_rollout_ref.model.external_lib`, which raise on failure where the entry
point only logs at DEBUG) registers one loss per method in `pdmctl.masks.METHODS`
as `pdmctl_<method>` (installed mask plugins' included: `pdmctl.plugins`), and installs the top-K patch when
`PDMCTL_VERL_TOPK` is set.

Select a loss with

    actor_rollout_ref.actor.policy_loss._target_=pdmctl.backends.verl.plugin.PdmPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=pdmctl_pdm
    +actor_rollout_ref.actor.policy_loss.divergence=topk_kl ...   (see launch.py)

The registered functions hold no mask math: `pdmctl.backends.verl.topk` runs
`pdmctl.masks.token_diagnostics` on the full logits, and the loss here weights
VeRL's `log_prob` by it and aggregates with VeRL's `agg_loss` (global-batch
normalisation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, agg_loss, register_policy_loss
from verl.workers.config import PolicyLossConfig

from pdmctl import masks, plugins
from pdmctl.backends.verl import actor_loss, patches, resume, safeload, topk
from pdmctl.backends.verl.topk import LOSS_PREFIX, is_pdmctl_loss, loss_name, method_of_loss

__all__ = ["LOSS_PREFIX", "PdmPolicyLossConfig", "check_run_config", "is_pdmctl_loss", "loss_name",
           "method_of_loss", "registered_losses"]  # fmt: skip
PLUGIN_MODULE = __name__


def registered_losses() -> list[str]:
    return [name for name in POLICY_LOSS_REGISTRY if is_pdmctl_loss(name)]


@dataclass
class PdmPolicyLossConfig(PolicyLossConfig):
    """VeRL's PolicyLossConfig plus the mask's hyperparameters (VeRL rejects unknown `+` keys).

    ε_low/ε_high (GRPO) and the ratio cap C come from VeRL's own actor fields
    `clip_ratio_low`, `clip_ratio_high` and `clip_ratio_c`, which mean the same there (`clip_ratio_c`
    inf: no cap; for GRPO it is VeRL's dual clip).
    """

    topk: int = 20  # K: vLLM's default max_logprobs, DPPO's choice
    delta: float = 0.15  # δ (δ_high where A ≥ 0)
    delta_low: float | None = None  # δ_low where A < 0; None = δ
    divergence: str = "topk_kl"
    estimator: str = "agg"

    def __post_init__(self) -> None:
        for arg, value, registry in (
            ("divergence", self.divergence, masks.DIVERGENCES),
            ("estimator", self.estimator, masks.ESTIMATORS),
        ):
            if value not in registry:
                raise ValueError(f"policy_loss.{arg}: unknown {value!r}; choose from {sorted(registry)}")
        if self.topk < 1:
            raise ValueError(f"policy_loss.topk: must be >= 1, got {self.topk}")


def _make_loss(method: str) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    def loss_fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
        **_: Any,  # VeRL's call site and type comment disagree on the last keyword; accept both
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        d = actor_loss.current_diagnostics()
        # MATH.md, "The loss": DPPO, PDM −A · sg(min(r, C)) · M · log π_k; GRPO VeRL's PPO clip with the
        # dual clip at C. r is to the rollout's log-probs (the diagnostics'), not VeRL's `old_log_prob`;
        # C = clip_ratio_c, inf (or null): no cap
        token_loss = masks.token_loss(
            method, log_prob, d.ratio, advantages, d.keep, ratio_cap=config.clip_ratio_c,
            eps_low=config.clip_ratio_low, eps_high=config.clip_ratio_high,
        )  # fmt: skip
        if rollout_is_weights is not None:
            token_loss = token_loss * rollout_is_weights
        loss = agg_loss(token_loss, response_mask, loss_agg_mode, **config.global_batch_info)
        actor_loss.dump_once(
            "loss", loss=loss.detach(), token_loss=token_loss.detach(), log_prob=log_prob.detach(),
            response_mask=response_mask, advantages=advantages, keep=d.keep, ratio=d.ratio,
        )  # fmt: skip
        return loss, {**verl_metrics(d, response_mask), **rollout_gap(log_prob, d.log_ratio, response_mask)}

    loss_fn.__name__ = f"compute_policy_loss_{loss_name(method)}"
    loss_fn.__doc__ = f"pdmctl's `{method}` mask (pdmctl.masks.METHODS[{method!r}]) as a VeRL policy loss."
    return loss_fn


def verl_metrics(d: masks.Diagnostics, response_mask: torch.Tensor) -> dict[str, float]:
    """pdmctl's update metrics under `actor/pdmctl/*`, plus VeRL's standard names for the same numbers."""
    flat = masks.Diagnostics(**{name: getattr(d, name).reshape(-1) for name in topk.DIAGNOSTIC_KEYS})
    metrics = masks.update_metrics(flat, response_mask.reshape(-1).bool())
    out: dict[str, float] = {f"actor/pdmctl/{name}": value for name, value in metrics.items()}
    out["actor/pg_clipfrac"] = metrics["mask_frac"]
    out["actor/ppo_kl"] = metrics["ppo_kl"]
    return out


def rollout_gap(log_prob: torch.Tensor, log_ratio: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """The rollout/trainer gap, mean |π_θ(k) − μ(k)| over the response tokens, as VeRL's
    `training/rollout_probs_diff_mean` defines it. VeRL computes it only beside its recompute of old log-probs,
    which pdmctl's runs skip (`algorithm.rollout_correction.bypass_mode`): here it is each micro-batch's own
    forward, so the step's first mini-batch gives VeRL's figure and its later ones include the step's updates."""
    mask = response_mask.reshape(-1).to(torch.float64)
    pi = log_prob.detach().reshape(-1).to(torch.float64)
    mu = pi - log_ratio.detach().reshape(-1).to(torch.float64)
    gap = (pi.exp() - mu.exp()).abs()
    return {"actor/pdmctl/rollout_probs_diff_mean": float((gap * mask).sum() / mask.sum().clamp_min(1))}


# installed mask plugins (pdmctl.plugins) are methods too; one that does not load is named where a run asks for it
PLUGIN_PROBLEMS = plugins.load_all("mask")
for _method in masks.METHODS:
    register_policy_loss(loss_name(_method))(_make_loss(_method))


class PluginCheckError(RuntimeError):
    """The run would fail after its first rollout; stop before it."""


def check_run_config(config: Mapping[str, Any] | Any) -> None:
    """The fail-fast check: run in the driver before Ray starts the first rollout.

    VeRL looks the loss name up only at the first actor update, after a full
    rollout; a plugin that failed to load is logged at DEBUG only. This raises a
    `PluginCheckError` with what to fix instead.
    """
    from omegaconf import OmegaConf

    topk.check_verl_version()
    actor = OmegaConf.select(config, "actor_rollout_ref.actor")
    policy_loss = actor.policy_loss
    name = policy_loss.loss_mode
    if name not in POLICY_LOSS_REGISTRY:
        raise PluginCheckError(
            f"policy loss {name!r} is not registered with VeRL (registered: {sorted(POLICY_LOSS_REGISTRY)}); "
            f"is the pdmctl plugin ({PLUGIN_MODULE}) importable on this node?"
            + "".join(f"; {problem}" for problem in PLUGIN_PROBLEMS)
        )
    if not is_pdmctl_loss(name):
        return
    target = policy_loss.get("_target_")
    expected = f"{PdmPolicyLossConfig.__module__}.{PdmPolicyLossConfig.__qualname__}"
    if target != expected:
        raise PluginCheckError(f"policy_loss._target_ must be {expected} for {name!r}, got {target!r}")
    PdmPolicyLossConfig(**{k: v for k, v in OmegaConf.to_container(policy_loss).items() if k != "_target_"})
    if actor.strategy not in ("fsdp", "fsdp2", "megatron"):
        raise PluginCheckError(
            f"{name!r} needs the logits in the logits-processor path, wired for the FSDP and Megatron engines; "
            f"actor.strategy={actor.strategy!r}"
        )
    if actor.strategy == "megatron":
        megatron = actor.megatron
        if not megatron.get("use_remove_padding", True):
            raise PluginCheckError(
                f"{name!r} on Megatron needs the packed THD layout: set use_remove_padding=true"
            )
        if megatron.get("dynamic_context_parallel", False):
            raise PluginCheckError(
                f"{name!r}: dynamic context parallelism is not supported (VeRL refuses it too)"
            )
        if megatron.get("pad_to_length", False):
            raise PluginCheckError(f"{name!r}: pad_to_length is not supported with the logits processor")
    elif actor.get("pad_to_length", False) or OmegaConf.select(
        actor, "fsdp_config.pad_to_length", default=False
    ):
        # VeRL's FSDP engine raises this itself, but only at the first actor update
        raise PluginCheckError(f"{name!r}: pad_to_length is not supported with the logits processor")
    if OmegaConf.select(config, "actor_rollout_ref.model.use_fused_kernels"):
        raise PluginCheckError(
            f"{name!r}: set actor_rollout_ref.model.use_fused_kernels=false (no logits otherwise)"
        )
    if int(actor.get("ulysses_sequence_parallel_size", 1)) > 1:
        raise PluginCheckError(f"{name!r}: ulysses_sequence_parallel_size must be 1")
    if not OmegaConf.select(config, "actor_rollout_ref.rollout.calculate_log_probs"):
        raise PluginCheckError(f"{name!r}: set actor_rollout_ref.rollout.calculate_log_probs=true (μ_k)")
    if OmegaConf.select(config, "trainer.use_v1") and not patches.v1_available():
        raise PluginCheckError(
            f"{name!r}: VeRL's V1 trainer needs TransferQueue==0.1.11 (scripts/engine-env.sh installs it); "
            "or set trainer.use_v1=false"
        )
    k = patches.configured_topk()
    if k != int(policy_loss.topk):
        raise PluginCheckError(
            f"{topk.TOPK_ENV}={k} but policy_loss.topk={policy_loss.topk}: the job body must export "
            f"{topk.TOPK_ENV} to every Ray worker (and the rollout must request that many log-probs)"
        )


if patches.configured_topk() > 0:
    patches.install()
resume.install()  # a resumed job logs no step twice (only where the job set MLFLOW_RUN_ID)
safeload.install()  # the run's checkpoint files load as weights only (only where the job set PDMCTL_CHECKPOINT_DIR)
