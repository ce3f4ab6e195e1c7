"""GRPO's loss is VeRL 0.9.1's PPO clip, `compute_policy_loss_vanilla`, dual clip included, in value and
gradient, on the CPU testbed (`masks.policy_loss`) and as the VeRL loss `pdmctl_grpo`; its keep mask is
where that loss has a gradient; every method's ratio is π_k/μ_k with μ the rollout's log-probs."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

pytest.importorskip("verl")

import torch
from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla, get_policy_loss_fn
from verl.workers.config import ActorConfig

from pdmctl import masks
from pdmctl.backends.verl import actor_loss, plugin

pytestmark = pytest.mark.verl

EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 10.0
B, T, VOCAB = 100, 1000, 8  # 10^5 tokens
# the aggregation modes of VeRL's `agg_loss` that pdmctl has too (VeRL's `token-sum` it has not)
SHARED_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
CAPS = [CAP, None]  # None: no cap, VeRL's clip_ratio_c=inf


@dataclasses.dataclass(frozen=True)
class Tokens:
    logits: torch.Tensor  # [B, T, V] float64
    sampled: torch.Tensor  # [B, T]
    rollout_logprobs: torch.Tensor  # [B, T] log μ_k, the rollout's
    advantages: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] response tokens


@functools.cache
def tokens() -> Tokens:
    """10^5 tokens whose log r = log π_k − log μ_k covers every region of the clip: uniform over
    [log 0.05, log 50], plus 1% beyond each side of VeRL's ±20 clamp; none within 1e-5 of a boundary (the
    diagnostics' float32 r decides the side VeRL's float64 r does). π is built so that log_softmax gives
    exactly the chosen log π_k; advantages of both signs, 5% of them 0; sequences of random length."""
    g = torch.Generator().manual_seed(0)
    n = B * T
    log_r = torch.empty(n, dtype=torch.float64).uniform_(math.log(0.05), math.log(50.0), generator=g)
    far = torch.rand(n, generator=g, dtype=torch.float64)
    beyond = 20.0 + 5.0 * torch.rand(n, generator=g, dtype=torch.float64)
    log_r = torch.where(far < 0.01, beyond, torch.where(far > 0.99, -beyond, log_r))
    for boundary in (math.log(1 - EPS_LOW), math.log(1 + EPS_HIGH), math.log(CAP), -20.0, 20.0):
        log_r = torch.where((log_r - boundary).abs() < 1e-5, boundary + 2e-5, log_r)
    log_pi_k = log_r.clamp(max=0) - torch.empty(n, dtype=torch.float64).uniform_(0.5, 3.0, generator=g)
    sampled = torch.randint(0, VOCAB, (n,), generator=g)
    z = torch.randn(n, VOCAB, generator=g, dtype=torch.float64)
    others = z.scatter(-1, sampled[:, None], -math.inf).logsumexp(-1)
    z_k = others + log_pi_k - torch.log1p(-log_pi_k.exp())  # π_k / (1 − π_k) = e^{z_k} / Σ_{j≠k} e^{z_j}
    z = z.scatter(-1, sampled[:, None], z_k[:, None])
    torch.testing.assert_close(torch.log_softmax(z, -1).gather(-1, sampled[:, None])[:, 0], log_pi_k)
    advantages = torch.randn(n, generator=g).double()  # float32 values, as the testbed casts them
    advantages[torch.rand(n, generator=g) < 0.05] = 0.0
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    return Tokens(
        z.view(B, T, VOCAB), sampled.view(B, T), (log_pi_k - log_r).view(B, T), advantages.view(B, T), mask
    )


@functools.cache
def diagnostics(method: str, cap: float | None) -> masks.Diagnostics:
    """`token_diagnostics` of `tokens()`, [B, T] each, as the VeRL loss reads them."""
    t = tokens()
    flat = masks.token_diagnostics(
        t.logits.reshape(-1, VOCAB), t.sampled.reshape(-1), t.sampled.reshape(-1, 1), t.rollout_logprobs.reshape(-1, 1),
        t.rollout_logprobs.reshape(-1), t.advantages.reshape(-1), method=method, delta=1e6, eps_low=EPS_LOW,
        eps_high=EPS_HIGH, ratio_cap=cap,
    )  # fmt: skip
    return masks.Diagnostics(**{f.name: getattr(flat, f.name).view(B, T) for f in dataclasses.fields(flat)})


def verl_config(cap: float | None, mode: str) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH,
        clip_ratio_c=math.inf if cap is None else cap, loss_agg_mode=mode,
        ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
    )  # fmt: skip


def log_probs(logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, sampled[..., None]).squeeze(-1)


def verl_vanilla(log_prob: torch.Tensor, cap: float | None, mode: str):
    """VeRL's own loss on log π_k, with the rollout's log-probs as its `old_log_prob`."""
    t = tokens()
    return compute_policy_loss_vanilla(
        old_log_prob=t.rollout_logprobs, log_prob=log_prob, advantages=t.advantages, response_mask=t.mask,
        loss_agg_mode=mode, config=verl_config(cap, mode),
    )  # fmt: skip


def test_the_tokens_cover_every_region_of_the_clip() -> None:
    """The comparisons below are not vacuous: thousands of response tokens in each region."""
    t = tokens()
    r = (log_probs(t.logits, t.sampled) - t.rollout_logprobs).exp()
    a, inside = t.advantages, t.mask.bool()
    regions = {
        "dual clip (A<0, C<r<e^20)": (a < 0) & (r > CAP) & (r < math.exp(20)),
        "clipped high (A>0, r>1+ε_high)": (a > 0) & (r > 1 + EPS_HIGH),
        "clipped low (A<0, r<1−ε_low)": (a < 0) & (r < 1 - EPS_LOW),
        "unclipped (A>0, r≤1+ε_high)": (a > 0) & (r <= 1 + EPS_HIGH) & (r > math.exp(-20)),
        "unclipped (A<0, 1−ε_low≤r≤C)": (a < 0) & (r >= 1 - EPS_LOW) & (r <= CAP),
        "beyond VeRL's clamp (|log r|>20)": (r < math.exp(-20)) | (r > math.exp(20)),
        "A=0": a == 0,
    }
    counts = {name: int((region & inside).sum()) for name, region in regions.items()}
    assert all(count >= 400 for count in counts.values()), counts


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("mode", SHARED_MODES)
def test_grpo_policy_loss_is_verls_vanilla_loss_in_value_and_gradient(mode: str, cap: float | None) -> None:
    """`masks.policy_loss` (the CPU testbed) for GRPO against VeRL's `compute_policy_loss_vanilla` on the
    same float64 log-probs (the rollout's as `old_log_prob`): the loss, the gradient w.r.t. the logits and
    w.r.t. each log π_k; and its keep mask (and `mask_frac`) is exactly where VeRL's gradient is not 0."""
    t = tokens()
    assert mode in masks.AGGREGATIONS
    leaf = t.logits.clone().requires_grad_(True)
    loss, metrics = masks.policy_loss(
        leaf, t.sampled, t.sampled[..., None], t.rollout_logprobs[..., None], t.rollout_logprobs, t.advantages,
        t.mask, method="grpo", eps_low=EPS_LOW, eps_high=EPS_HIGH, loss_agg_mode=mode, ratio_cap=cap,
    )  # fmt: skip
    loss.backward()
    ref_leaf = t.logits.clone().requires_grad_(True)
    log_prob = log_probs(ref_leaf, t.sampled)
    log_prob.retain_grad()
    ref, _ = verl_vanilla(log_prob, cap, mode)
    ref.backward()

    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-6, atol=1e-15)
    # a row's gradient is ∂L/∂log π_k · (e_k − π): read ∂L/∂log π_k off the sampled column
    pi_k = log_probs(t.logits, t.sampled).exp()
    grad_log_prob = leaf.grad.gather(-1, t.sampled[..., None]).squeeze(-1) / (1 - pi_k)
    torch.testing.assert_close(grad_log_prob, log_prob.grad, rtol=1e-6, atol=1e-15)

    inside = t.mask.bool()
    no_gradient = (log_prob.grad == 0) & (t.advantages != 0)  # at A = 0 no method masks (MATH.md)
    keep = diagnostics("grpo", cap).keep
    assert torch.equal(~keep & inside, no_gradient & inside)
    assert metrics["mask_frac"] == pytest.approx(
        int((no_gradient & inside).sum()) / int(inside.sum()), rel=1e-12
    )


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("mode", SHARED_MODES)
def test_the_verl_loss_pdmctl_grpo_is_verls_vanilla_loss(mode: str, cap: float | None) -> None:
    """The registered `pdmctl_grpo`, called as VeRL's `ppo_loss` calls it, against `compute_policy_loss_vanilla`
    on the same log-probs: value and gradient w.r.t. `log_prob`. It takes r from the diagnostics (to the
    rollout's log-probs), so VeRL's own `old_log_prob` (here a recomputed one that differs) changes nothing."""
    t = tokens()
    log_prob = log_probs(t.logits, t.sampled)
    leaf = log_prob.clone().requires_grad_(True)
    recomputed_old = t.rollout_logprobs + 0.3 * torch.randn(B, T, generator=torch.Generator().manual_seed(1))
    with actor_loss.diagnostics_scope(diagnostics("grpo", cap)):
        loss, metrics = get_policy_loss_fn(plugin.loss_name("grpo"))(
            old_log_prob=recomputed_old, log_prob=leaf, advantages=t.advantages, response_mask=t.mask,
            loss_agg_mode=mode, config=verl_config(cap, mode),
        )  # fmt: skip
    loss.backward()
    ref_leaf = log_prob.clone().requires_grad_(True)
    ref, ref_metrics = verl_vanilla(ref_leaf, cap, mode)
    ref.backward()

    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-6, atol=1e-15)
    # pdmctl's clip fraction: every token without a gradient, VeRL's two clip fractions and its clamp's
    inside = t.mask.bool()
    no_gradient = (ref_leaf.grad == 0) & (t.advantages != 0) & inside
    assert metrics["actor/pg_clipfrac"] == pytest.approx(
        int(no_gradient.sum()) / int(inside.sum()), rel=1e-12
    )
    verl_clipped = ref_metrics["actor/pg_clipfrac"] + ref_metrics["actor/pg_clipfrac_lower"]
    assert metrics["actor/pg_clipfrac"] >= verl_clipped - 1e-12


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("mode", SHARED_MODES)
def test_token_loss_is_verls_formula_to_float64_rounding(mode: str, cap: float | None) -> None:
    """`masks.token_loss`, the one function both backends call, given the float64 ratio exp(log π_k − log μ_k)
    and aggregated by VeRL's `agg_loss`, is `compute_policy_loss_vanilla` to float64 rounding."""
    t = tokens()
    log_prob = log_probs(t.logits, t.sampled)
    leaf = log_prob.clone().requires_grad_(True)
    ratio = (log_prob - t.rollout_logprobs).exp()
    losses = masks.token_loss("grpo", leaf, ratio, t.advantages, torch.ones_like(t.mask, dtype=torch.bool),
                              ratio_cap=cap, eps_low=EPS_LOW, eps_high=EPS_HIGH)  # fmt: skip
    loss = agg_loss(losses, t.mask, mode)
    loss.backward()
    ref_leaf = log_prob.clone().requires_grad_(True)
    ref, _ = verl_vanilla(ref_leaf, cap, mode)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-13, atol=0)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-13, atol=0)


@pytest.mark.parametrize("method", sorted(masks.METHODS))
def test_every_method_clips_the_ratio_to_the_rollouts_log_probs_not_verls_old_log_prob(method: str) -> None:
    """The VeRL loss of each method gives the same loss and gradient whatever VeRL's `old_log_prob`, and the
    ratio it weights by is π_k/μ_k with μ_k the rollout's (`rollout_log_probs`)."""
    t = tokens()
    log_prob = log_probs(t.logits, t.sampled)
    d = diagnostics(method, CAP)
    torch.testing.assert_close(
        d.ratio.double(), (log_prob - t.rollout_logprobs).clamp(-80, 80).exp(), rtol=1e-6, atol=0
    )
    results = []
    for old in (t.rollout_logprobs, t.rollout_logprobs + 1.0, torch.zeros_like(log_prob)):
        leaf = log_prob.clone().requires_grad_(True)
        with actor_loss.diagnostics_scope(d):
            loss, _ = get_policy_loss_fn(plugin.loss_name(method))(
                old_log_prob=old, log_prob=leaf, advantages=t.advantages, response_mask=t.mask,
                config=verl_config(CAP, "token-mean"),
            )  # fmt: skip
        loss.backward()
        results.append((loss, leaf.grad))
    for loss, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
