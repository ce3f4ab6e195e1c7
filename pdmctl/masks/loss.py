"""Trust-region masks for LLM RL: GRPO clip-higher, DPPO and the predictive divergence mask.

This module is `docs/MATH.md` in code, symbol for symbol (`mu_tail`, `pi_tail`,
`q_tail`, `ddot`). It is pure torch: no I/O, no config objects, nothing about
MLflow, SLURM, Hydra or VeRL. Both backends (the CPU testbed and VeRL) call it.

Variants are registered by name: a divergence family (KL, TV) is a pair of
functions `D` and `Ḋ`; a divergence is a family on a support (top-K or binary);
an estimator gives `Q_tail`; a method turns the token quantities into a keep
mask; an aggregation mode turns token losses into a scalar. Adding one is
adding a function with its decorator.

Numerics: most tokens of a trained policy have `1 − π_k` between 1e-9 and 1e-5,
below float32's resolution near 1, so `π_tail = 1 − Σ_S π_i` is never formed
by that subtraction. One blocked pass over the logits sums `e_j = exp(z_j − max z)`
over the unseen tokens only (the support's columns zeroed in the block), which
gives `Σ_{j∉S} e_j` and, for the `exact` estimator, `Σ_{j∉S} e_j²` to float32's
relative precision however small they are; the support's own `e_i` are taken
from the logits in float64. Then, in float64, `Σ_j e_j = Σ_S e_i + Σ_{j∉S} e_j`,
`log π_i = z_i − max z − log Σ_j e_j`, `π_tail = Σ_{j∉S} e_j / Σ_j e_j` and
`Q_tail = Σ_{j∉S} e_j² / (Σ_j e_j)²`: no difference of nearly equal numbers
anywhere. The pass allocates nothing of size [N, V] (bfloat16 logits are widened
to float32 a block at a time). `policy_loss` takes its gradient through a
log-softmax and its mask from the same pass as `compute_mask`, so both give the
same `D` and `Ḋ`.

The pass itself (in torch, or one fused Triton kernel on a CUDA device) is `pdmctl.masks.rows`.

Vocabulary-parallel logits (Megatron's tensor parallelism: each rank holds the
columns `[start, start + V_local)`) go through the same code with a `VocabShard`:
the row maximum and the tail sums are all-reduced over the shard's process group,
and `z` at a support id is taken on the rank that owns the id and summed over the
group, so every rank gets the whole-vocabulary answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdmctl.masks.rows import (  # noqa: F401  (re-exported: masks.VocabShard, masks.fused_row_stats, ...)
    _CHUNK_ELEMENTS,
    KERNEL_CHOICES,
    KERNEL_ENV,
    VocabShard,
    _blocked_row_stats,
    _tail_sums,
    _work_dtype,
    fused_row_stats,
    kernel_choice,
)

EPS = 1e-12  # clamp for tail masses (MATH.md: clamp both to >= ε)
_MAX_LOG_RATIO = 80.0  # exp(80) < float32 max: the ratio stays finite for any valid input
_LOGPROB_TOL = 1e-4  # engines round log-probabilities; a probability of 1 may come back as +1e-7
_VERL_RATIO = (math.exp(-20.0), math.exp(20.0))  # VeRL's PPO clip clamps log r to ±20: no gradient beyond


# ---------------------------------------------------------------------------
# Token quantities on the support S = TopK(mu) ∪ {k}
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Support:
    """Per-token quantities on the support, float64, shape [N, m_max] or [N]."""

    valid: torch.Tensor  # bool [N, m]: slot i is a member of S
    is_k: torch.Tensor  # bool [N, m]: slot i is the sampled token k
    pi: torch.Tensor  # π_i on S (0 where not valid)
    mu: torch.Tensor  # μ_i on S (0 where not valid)
    log_pi: torch.Tensor  # log π_i (0 where not valid)
    log_mu: torch.Tensor  # log μ_i (0 where not valid)
    log_pi_k: torch.Tensor  # [N] log π_k
    pi_k: torch.Tensor  # [N] π_k
    mu_k: torch.Tensor  # [N] μ_k as it enters D (the support's own value)
    pi_tail: torch.Tensor  # [N] clamp(1 − Σ_S π_i, ε), summed over the unseen tokens (see Numerics)
    mu_tail: torch.Tensor  # [N] clamp(1 − Σ_S μ_i, ε)
    n_minus_m: torch.Tensor  # [N] unseen vocabulary size n − |S| (at least 1)


@dataclass(frozen=True)
class DivergenceFamily:
    name: str
    divergence: Callable[[Support], torch.Tensor]  # D, [N]
    ddot: Callable[[Support, torch.Tensor], torch.Tensor]  # (support, q_tail) -> Ḋ, [N]


@dataclass(frozen=True)
class DivergenceSpec:
    name: str
    family: DivergenceFamily
    support: str  # "topk": S = TopK ∪ {k};  "binary": S = {k}


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    # (support, Σ_{j∉S} π_j² or None) -> Q_tail
    q_tail: Callable[[Support, torch.Tensor | None], torch.Tensor]
    needs_tail_sum_sq: bool  # needs Σ_{j∉S} π_j², a reduction over the whole vocabulary


@dataclass(frozen=True)
class MaskInputs:
    """What a method decides on, per token ([N] each)."""

    advantages: torch.Tensor
    ratio: torch.Tensor
    divergence: torch.Tensor | None
    ddot: torch.Tensor | None
    delta: torch.Tensor  # δ_high where A ≥ 0 (A = 0 included: MATH.md, "At A = 0"), δ_low where A < 0
    eps_low: float
    eps_high: float
    ratio_cap: float | None = None  # C (finite), or None: no cap


@dataclass(frozen=True)
class MethodSpec:
    name: str
    masked: Callable[[MaskInputs], torch.Tensor]  # bool [N]: True where the gradient is dropped
    uses_divergence: bool
    uses_ddot: bool
    clipped_surrogate: bool = False  # its loss: VeRL's PPO clip, not the masked score (`token_loss`)


FAMILIES: dict[str, DivergenceFamily] = {}
DIVERGENCES: dict[str, DivergenceSpec] = {}
ESTIMATORS: dict[str, EstimatorSpec] = {}
METHODS: dict[str, MethodSpec] = {}
AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def register_family(name: str, ddot: Callable[[Support, torch.Tensor], torch.Tensor]):
    def wrap(fn: Callable[[Support], torch.Tensor]) -> Callable[[Support], torch.Tensor]:
        FAMILIES[name] = DivergenceFamily(name, fn, ddot)
        return fn

    return wrap


def register_divergence(name: str, family: str, support: str) -> None:
    if support not in ("topk", "binary"):
        raise ValueError(f"support must be 'topk' or 'binary', got {support!r}")
    DIVERGENCES[name] = DivergenceSpec(name, FAMILIES[family], support)


def register_estimator(name: str, *, needs_tail_sum_sq: bool = False):
    def wrap(fn):
        ESTIMATORS[name] = EstimatorSpec(name, fn, needs_tail_sum_sq)
        return fn

    return wrap


def register_method(name: str, *, uses_divergence: bool, uses_ddot: bool, clipped_surrogate: bool = False):
    def wrap(fn):
        METHODS[name] = MethodSpec(name, fn, uses_divergence, uses_ddot, clipped_surrogate)
        return fn

    return wrap


def register_aggregation(name: str):
    def wrap(fn):
        AGGREGATIONS[name] = fn
        return fn

    return wrap


# ---------------------------------------------------------------------------
# Ḋ: the directional derivative of D along v = e_k − π
# ---------------------------------------------------------------------------


def ddot_from_gradient(
    s: Support, g: torch.Tensor, g_tail: torch.Tensor, q_tail: torch.Tensor
) -> torch.Tensor:
    """MATH.md, for any D that sees the unseen tokens only through π_tail (gradient g_i on S, g_tail):

    Ḋ = Σ_S (g_i − g_tail) π_i w_i,   w_i = 1[i=k] − π_i − ⟨π, v⟩ = dπ_i/dη / π_i

    (the tail's own change is −Σ_S dπ_i, so g_tail enters only as the offset). Every quantity is a sum
    of positive terms: 1 − π_k = π_tail + Σ_{S∖k} π_i, Q − π_k² = Σ_{S∖k} π_i² + Q_tail, so
    ⟨π, v⟩ = π_k (1 − π_k) − (Q − π_k²), w_k = (1 − π_k)² + Q − π_k², w_i = −π_i − ⟨π, v⟩ (i ≠ k).
    No term of size 1 cancels, so Ḋ keeps its sign when it is of the size of π_k ≪ 1e-16 (binary TV).
    """
    others = s.valid & ~s.is_k
    rest = s.pi_tail + (s.pi * others).sum(-1)  # 1 − π_k
    q_rest = (s.pi * s.pi * others).sum(-1) + q_tail  # Q − π_k²
    pi_dot_v = s.pi_k * rest - q_rest  # ⟨π, v⟩ = π_k − Q
    w = torch.where(s.is_k, (rest * rest + q_rest)[:, None], -s.pi - pi_dot_v[:, None])
    h = torch.where(s.valid, (g - g_tail[:, None]) * s.pi, torch.zeros_like(s.pi))
    return (h * w).sum(-1)


def _ddot_kl(s: Support, q_tail: torch.Tensor) -> torch.Tensor:
    # Ḋ_KL = (μ_tot π_k − μ_k) + Σ_S π_i (μ_i − μ_tot π_i) + Q_tail (μ_tail/π_tail − μ_tot),  μ_tot = Σ_S μ_i + μ_tail
    # (the general formula with g_i = −μ_i/π_i, simplified so that no π_i is divided by). μ_tot is 1
    # unless the rollout's top-K sums above 1 (rounded log-probabilities) and μ_tail is clamped to ε:
    # then this is still the derivative of the D that is thresholded, with that clamped μ_tail.
    mu_total = s.mu.sum(-1) + s.mu_tail
    local = mu_total * s.pi_k - s.mu_k
    coupling = (s.pi * (s.mu - mu_total[:, None] * s.pi)).sum(-1)
    tail = q_tail * (s.mu_tail / s.pi_tail - mu_total)
    return local + coupling + tail


def _ddot_tv(s: Support, q_tail: torch.Tensor) -> torch.Tensor:
    # g_i = ½ sign(π_i − μ_i), g_tail = ½ sign(π_tail − μ_tail)
    g = 0.5 * torch.sign(s.pi - s.mu)
    g_tail = 0.5 * torch.sign(s.pi_tail - s.mu_tail)
    return ddot_from_gradient(s, g, g_tail, q_tail)


@register_family("kl", ddot=_ddot_kl)
def _kl(s: Support) -> torch.Tensor:
    # D = Σ_S μ_i log(μ_i/π_i) + μ_tail log(μ_tail/π_tail);  0·log 0 = 0 on empty slots
    on_support = torch.where(s.valid & (s.mu > 0), s.mu * (s.log_mu - s.log_pi), torch.zeros_like(s.mu))
    return on_support.sum(-1) + s.mu_tail * (torch.log(s.mu_tail) - torch.log(s.pi_tail))


@register_family("tv", ddot=_ddot_tv)
def _tv(s: Support) -> torch.Tensor:
    # D = ½ (Σ_S |μ_i − π_i| + |μ_tail − π_tail|)
    return 0.5 * ((s.mu - s.pi).abs().sum(-1) + (s.mu_tail - s.pi_tail).abs())


register_divergence("topk_kl", "kl", "topk")
register_divergence("topk_tv", "tv", "topk")
register_divergence("binary_kl", "kl", "binary")  # S = {k}: μ_k log(μ_k/π_k) + (1−μ_k) log((1−μ_k)/(1−π_k))
register_divergence("binary_tv", "tv", "binary")  # S = {k}: |μ_k − π_k|


@register_estimator("agg")
def _q_tail_agg(s: Support, tail_sum_sq: torch.Tensor | None) -> torch.Tensor:
    return s.pi_tail**2  # the tail as one token (an upper bound)


@register_estimator("uni")
def _q_tail_uni(s: Support, tail_sum_sq: torch.Tensor | None) -> torch.Tensor:
    return s.pi_tail**2 / s.n_minus_m  # the tail spread evenly (a lower bound)


@register_estimator("exact", needs_tail_sum_sq=True)
def _q_tail_exact(s: Support, tail_sum_sq: torch.Tensor | None) -> torch.Tensor:
    assert tail_sum_sq is not None
    return tail_sum_sq  # Σ_{j∉S} π_j², summed directly (not as Σ_j π_j² − Σ_S π_i², which cancels)


# ---------------------------------------------------------------------------
# Methods: when is a token masked?
# ---------------------------------------------------------------------------


@register_method("grpo", uses_divergence=False, uses_ddot=False, clipped_surrogate=True)
def _grpo(t: MaskInputs) -> torch.Tensor:
    # no gradient in VeRL's PPO clip: A>0 ∧ r>1+ε_high, A<0 ∧ r<1−ε_low, A<0 ∧ r>C (dual clip), |log r|>20
    a, r, cap = t.advantages, t.ratio, math.inf if t.ratio_cap is None else t.ratio_cap
    beyond = (a != 0) & ((r < _VERL_RATIO[0]) | (r > _VERL_RATIO[1]))
    return beyond | ((a > 0) & (r > 1 + t.eps_high)) | ((a < 0) & ((r < 1 - t.eps_low) | (r > cap)))


@register_method("dppo", uses_divergence=True, uses_ddot=False)
def _dppo(t: MaskInputs) -> torch.Tensor:
    # ratio direction: D > δ ∧ A (r − 1) > 0
    assert t.divergence is not None
    return (t.divergence > t.delta) & (t.advantages * (t.ratio - 1) > 0)


@register_method("pdm", uses_divergence=True, uses_ddot=True)
def _pdm(t: MaskInputs) -> torch.Tensor:
    # predictive direction: D > δ ∧ A · Ḋ > 0
    assert t.divergence is not None and t.ddot is not None
    return (t.divergence > t.delta) & (t.advantages * t.ddot > 0)


# ---------------------------------------------------------------------------
# Aggregation of token losses [B, T] (the VeRL modes)
# ---------------------------------------------------------------------------


@register_aggregation("token-mean")
def _token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (loss * mask).sum() / mask.sum().clamp_min(1)


@register_aggregation("seq-mean-token-sum")
def _seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (loss * mask).sum(-1).mean()


@register_aggregation("seq-mean-token-mean")
def _seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp_min(1)).mean()


@register_aggregation("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Dr. GRPO: token sums normalised by the fixed horizon T, not by each length
    return (loss * mask).sum(-1).mean() / mask.shape[-1]


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskResult:
    keep: torch.Tensor  # bool [N]: True where the token's gradient is kept
    divergence: torch.Tensor | None  # float32 [N] (None for grpo)
    ddot: torch.Tensor | None  # float32 [N] (pdm only)
    ratio: torch.Tensor  # float32 [N] π_k / μ_k


@dataclass(frozen=True)
class Diagnostics:
    """Every token quantity, whatever the method (for metrics and the direction analysis)."""

    keep: torch.Tensor  # bool [N] the method's decision
    divergence: torch.Tensor  # float32 [N] D
    ddot: torch.Tensor  # float32 [N] Ḋ with the given estimator
    ratio: torch.Tensor  # float32 [N]
    log_ratio: torch.Tensor  # float32 [N] log π_k − log μ_k
    out_of_region: torch.Tensor  # bool [N] D > δ
    disagree: torch.Tensor  # bool [N] D > δ and the ratio and predictive directions differ


def compute_mask(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    method: str = "pdm",
    divergence: str = "topk_kl",
    estimator: str = "agg",
    delta: float = 0.15,
    delta_low: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ratio_cap: float | None = None,
) -> MaskResult:
    """The keep mask of one method, with the token quantities it used (see MATH.md)."""
    d = token_diagnostics(
        logits, sampled_ids, rollout_topk_ids, rollout_topk_logprobs, rollout_sampled_logprobs, advantages,
        method=method, divergence=divergence, estimator=estimator, delta=delta, delta_low=delta_low,
        eps_low=eps_low, eps_high=eps_high, ratio_cap=ratio_cap,
    )  # fmt: skip
    spec = METHODS[method]
    return MaskResult(
        keep=d.keep,
        divergence=d.divergence if spec.uses_divergence else None,
        ddot=d.ddot if spec.uses_ddot else None,
        ratio=d.ratio,
    )


def token_diagnostics(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    method: str = "pdm",
    divergence: str = "topk_kl",
    estimator: str = "agg",
    delta: float = 0.15,
    delta_low: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ratio_cap: float | None = None,
    shard: VocabShard | None = None,
) -> Diagnostics:
    """D, Ḋ, r and the keep mask for every token, computed whatever the method.

    `ratio_cap` C (None or inf: none) enters GRPO's mask only (the dual clip). With `shard`, `logits` is this
    process's slice of a vocabulary-parallel row (ids stay global) and the result is the whole vocabulary's.
    """
    _check_names(method, divergence, estimator)
    cap = finite_cap(ratio_cap)
    if shard is not None:
        _check_shard(logits, shard)
    vocab = logits.shape[-1] if shard is None else shard.vocab_size
    _check_inputs(logits, vocab, sampled_ids, rollout_topk_ids, rollout_topk_logprobs, rollout_sampled_logprobs,
                  advantages, delta, delta_low)  # fmt: skip
    div = DIVERGENCES[divergence]
    est = ESTIMATORS[estimator]
    with torch.no_grad():
        s, tail_sum_sq = token_support(
            logits, sampled_ids, rollout_topk_ids, rollout_topk_logprobs, rollout_sampled_logprobs, div.support,
            need_tail_sum_sq=est.needs_tail_sum_sq, shard=shard,
        )  # fmt: skip
        q_tail = est.q_tail(s, tail_sum_sq)
        d_value = div.family.divergence(s)
        ddot = div.family.ddot(s, q_tail)

        log_ratio = (s.log_pi_k - rollout_sampled_logprobs.double()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio = log_ratio.exp()
        adv = advantages.double()
        delta_high = float(delta)
        delta_neg = float(delta if delta_low is None else delta_low)
        # A = 0 takes δ_high and no method masks it (MATH.md, "At A = 0"; VeRL's DPPO takes the A < 0 branch)
        delta_t = torch.where(adv < 0, torch.full_like(adv, delta_neg), torch.full_like(adv, delta_high))
        inputs = MaskInputs(adv, ratio, d_value, ddot, delta_t, eps_low, eps_high, cap)
        masked = METHODS[method].masked(inputs)
        out = d_value > delta_t
        disagree = out & ((adv * (ratio - 1) > 0) != (adv * ddot > 0))
        return Diagnostics(
            keep=~masked,
            divergence=d_value.float(),
            ddot=ddot.float(),
            ratio=ratio.float(),
            log_ratio=log_ratio.float(),
            out_of_region=out,
            disagree=disagree,
        )


def policy_loss(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    rollout_topk_ids: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    rollout_sampled_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    method: str = "pdm",
    divergence: str = "topk_kl",
    estimator: str = "agg",
    delta: float = 0.15,
    delta_low: float | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    loss_agg_mode: str = "token-mean",
    ratio_cap: float | None = 10.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`token_loss` of every token, aggregated (DPPO, PDM: −A · sg(min(r, C)) · M · log π_k, `ratio_cap` None:
    no cap, the paper's loss, arXiv 2607.10848, §2; GRPO: VeRL's PPO clip, dual clip at C).

    Token tensors are [B, T] (sequence modes aggregate over T) or [N] (one
    sequence); `logits` has one more trailing dimension, the vocabulary.
    """
    if loss_agg_mode not in AGGREGATIONS:
        raise ValueError(f"loss_agg_mode: unknown {loss_agg_mode!r}; choose from {sorted(AGGREGATIONS)}")
    finite_cap(ratio_cap)
    shape = sampled_ids.shape
    if response_mask.shape != shape:
        raise ValueError(f"response_mask: shape {tuple(response_mask.shape)} != sampled_ids {tuple(shape)}")
    vocab = logits.shape[-1]
    k = rollout_topk_ids.shape[-1]
    flat_ids = sampled_ids.reshape(-1)
    d = token_diagnostics(
        logits.detach().reshape(-1, vocab), flat_ids, rollout_topk_ids.reshape(-1, k),
        rollout_topk_logprobs.reshape(-1, k), rollout_sampled_logprobs.reshape(-1), advantages.reshape(-1),
        method=method, divergence=divergence, estimator=estimator, delta=delta, delta_low=delta_low,
        eps_low=eps_low, eps_high=eps_high, ratio_cap=ratio_cap,
    )  # fmt: skip
    # the gradient's log π_k: a float32 log-softmax is exact enough for e_k − π, not for 1 − π_k (the mask's)
    log_probs = torch.log_softmax(logits.reshape(-1, vocab), dim=-1, dtype=_work_dtype(logits))
    log_pi_k = log_probs.gather(-1, flat_ids.unsqueeze(-1)).squeeze(-1)
    per_seq = shape if len(shape) > 1 else (1, -1)  # a flat batch aggregates as one sequence
    losses = token_loss(method, log_pi_k, d.ratio, advantages.reshape(-1).float(), d.keep,
                        ratio_cap=ratio_cap, eps_low=eps_low, eps_high=eps_high).reshape(per_seq)  # fmt: skip
    loss = AGGREGATIONS[loss_agg_mode](losses, response_mask.reshape(per_seq).to(losses.dtype))
    return loss, update_metrics(d, response_mask.reshape(-1).bool())


def token_loss(method: str, log_prob: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, keep: torch.Tensor,
               *, ratio_cap: float | None, eps_low: float, eps_high: float) -> torch.Tensor:  # fmt: skip
    """Each token's loss (MATH.md, "The loss"), differentiable through `log_prob` (log π_k) only; `ratio`
    r = π_k/μ_k (μ the rollout's), a value; `keep` M; `ratio_cap` C (None or inf: none).
    DPPO, PDM: −A · sg(min(r, C)) · M · log π_k. GRPO: VeRL 0.9.1's `compute_policy_loss_vanilla` in value
    and gradient (∂r/∂log π_k = r, 0 where VeRL clamps log r to ±20): max(−A r, −A clip(r, 1 − ε_low,
    1 + ε_high)), and where A < 0 the dual clip min(−A C, that)."""
    cap = finite_cap(ratio_cap)
    if not METHODS[method].clipped_surrogate:
        weight = advantages * (ratio if cap is None else ratio.clamp(max=cap)) * keep.to(advantages.dtype)
        return -weight.detach() * log_prob
    value = ratio.detach().to(log_prob.dtype)
    inside = ((value >= _VERL_RATIO[0]) & (value <= _VERL_RATIO[1])).to(log_prob.dtype)
    r = value.clamp(*_VERL_RATIO) * (1 + inside * (log_prob - log_prob.detach()))  # value: exactly clamp(r)
    clipped = torch.maximum(-advantages * r, -advantages * r.clamp(1 - eps_low, 1 + eps_high))
    if cap is None:
        return clipped
    return torch.where(advantages < 0, torch.minimum(-advantages * cap, clipped), clipped)


def finite_cap(ratio_cap: float | None) -> float | None:
    """C as a float; None where there is no cap (None, or inf as VeRL's `clip_ratio_c` says it)."""
    if ratio_cap is None or ratio_cap == math.inf:
        return None
    if not ratio_cap > 0:
        raise ValueError(f"ratio_cap: must be > 0, got {ratio_cap}")
    return float(ratio_cap)


def update_metrics(d: Diagnostics, response_mask: torch.Tensor) -> dict[str, float]:
    """The per-update metrics of MATH.md, over the response tokens."""
    n = response_mask.sum().clamp_min(1).double()

    def mean(x: torch.Tensor) -> float:
        return float((x.double() * response_mask).sum() / n)

    return {
        "mask_frac": mean(~d.keep),
        "out_of_region_frac": mean(d.out_of_region),
        "mean_divergence": mean(d.divergence),
        "ppo_kl": mean(-d.log_ratio),  # E[log μ_k − log π_k], as VeRL reports it
        "disagreement_count": float((d.disagree & response_mask).sum()),
    }


# ---------------------------------------------------------------------------
# Internals
# ---------------------------------------------------------------------------


def token_support(
    logits: torch.Tensor,
    sampled_ids: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    kind: str,
    *,
    need_tail_sum_sq: bool,
    shard: VocabShard | None = None,
) -> tuple[Support, torch.Tensor | None]:
    """The support's quantities and, if asked, Σ_{j∉S} π_j² (float64 [N]), from one pass over the logits."""
    k_col = sampled_ids.unsqueeze(-1)
    if kind == "binary":  # S = {k}
        ids, log_mu = k_col, sampled_logprobs.unsqueeze(-1).double()
        valid = torch.ones_like(k_col, dtype=torch.bool)
    else:  # S = TopK(μ) ∪ {k}: K slots, plus k in slot K+1 when it is not among them
        valid_topk = torch.isfinite(topk_logprobs)  # -inf pads entries the engine did not return
        k_in_topk = ((topk_ids == k_col) & valid_topk).any(-1, keepdim=True)
        ids = torch.cat([torch.where(valid_topk, topk_ids, 0), k_col], dim=-1)
        log_mu = torch.cat([topk_logprobs, sampled_logprobs.unsqueeze(-1)], dim=-1).double()
        valid = torch.cat([valid_topk, ~k_in_topk], dim=-1)
    # the last slot holds k in both layouts (a member of S or, when k ∈ TopK, a copy of one)
    top, z_support, tail_sum, tail_sum_sq = _tail_sums(logits, ids, valid, need_tail_sum_sq, shard)
    if torch.isnan(top).any() or torch.isnan(tail_sum).any():  # NaN, or +inf − +inf, in some row
        raise ValueError("logits: contains NaN or +inf")
    zero = torch.zeros((), dtype=torch.float64, device=logits.device)
    e_support = torch.where(valid, (z_support - top[:, None]).exp(), zero)  # e_i = exp(z_i − max z), i ∈ S
    total = e_support.sum(-1) + tail_sum  # Σ_j e_j = Σ_S e_i + Σ_{j∉S} e_j
    log_pi_all = z_support - top[:, None] - total.log()[:, None]  # log π_i = z_i − log Σ_j exp z_j
    log_pi = torch.where(valid, log_pi_all, zero)
    log_mu = torch.where(valid, log_mu, zero)
    pi = torch.where(valid, log_pi.exp(), zero)
    mu = torch.where(valid, log_mu.exp(), zero)
    is_k = valid & (ids == k_col)
    vocab = logits.shape[-1] if shard is None else shard.vocab_size
    support = Support(
        valid=valid,
        is_k=is_k,
        pi=pi,
        mu=mu,
        log_pi=log_pi,
        log_mu=log_mu,
        log_pi_k=log_pi_all[:, -1],
        pi_k=log_pi_all[:, -1].exp(),
        mu_k=(mu * is_k).sum(-1),
        pi_tail=(tail_sum / total).clamp_min(EPS),  # Σ_{j∉S} π_j = 1 − Σ_S π_i without the cancellation
        mu_tail=(1.0 - mu.sum(-1)).clamp_min(EPS),  # μ is known on S only
        n_minus_m=(vocab - valid.sum(-1)).clamp_min(1).double(),
    )
    return support, (tail_sum_sq / total**2 if need_tail_sum_sq else None)


def _check_names(method: str, divergence: str, estimator: str) -> None:
    for arg, value, registry in (
        ("method", method, METHODS),
        ("divergence", divergence, DIVERGENCES),
        ("estimator", estimator, ESTIMATORS),
    ):
        if value not in registry:
            raise ValueError(f"{arg}: unknown {value!r}; choose from {sorted(registry)}")


def _check_shard(logits: torch.Tensor, shard: VocabShard) -> None:
    local = logits.shape[-1] if logits.dim() == 2 else -1
    if not (shard.start >= 0 and shard.start + local <= shard.vocab_size):
        raise ValueError(
            f"shard: columns [{shard.start}, {shard.start + local}) do not lie in a vocabulary of {shard.vocab_size}"
        )


def _check_inputs(
    logits: torch.Tensor,
    vocab: int,
    sampled_ids: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    sampled_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    delta: float,
    delta_low: float | None,
) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected a float tensor [N, V], got {tuple(logits.shape)} {logits.dtype}")
    n = logits.shape[0]
    if sampled_ids.shape != (n,):
        raise ValueError(f"sampled_ids: expected shape ({n},), got {tuple(sampled_ids.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.shape[1] < 1:
        raise ValueError(
            f"rollout_topk_ids: expected shape ({n}, K) with K >= 1, got {tuple(topk_ids.shape)}"
        )
    if topk_logprobs.shape != topk_ids.shape:
        raise ValueError(
            f"rollout_topk_logprobs: shape {tuple(topk_logprobs.shape)} != rollout_topk_ids {tuple(topk_ids.shape)}"
        )
    for name, t in (("rollout_sampled_logprobs", sampled_logprobs), ("advantages", advantages)):
        if t.shape != (n,):
            raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
    for name, t in (("sampled_ids", sampled_ids), ("rollout_topk_ids", topk_ids)):
        if t.is_floating_point():
            raise ValueError(f"{name}: expected integer token ids, got {t.dtype}")
    if n and (sampled_ids.min() < 0 or sampled_ids.max() >= vocab):
        raise ValueError(
            f"sampled_ids: ids must lie in [0, {vocab}), got [{sampled_ids.min()}, {sampled_ids.max()}]"
        )
    real_topk = topk_ids[torch.isfinite(topk_logprobs)]
    if real_topk.numel() and (real_topk.min() < 0 or real_topk.max() >= vocab):
        raise ValueError(
            f"rollout_topk_ids: ids must lie in [0, {vocab}), got [{real_topk.min()}, {real_topk.max()}]"
        )
    if torch.isnan(topk_logprobs).any() or (topk_logprobs > _LOGPROB_TOL).any():
        raise ValueError(
            "rollout_topk_logprobs: must be log-probabilities (<= 0, -inf for padding), got NaN or > 0"
        )
    if not torch.isfinite(sampled_logprobs).all() or (sampled_logprobs > _LOGPROB_TOL).any():
        raise ValueError("rollout_sampled_logprobs: must be finite log-probabilities (<= 0)")
    if torch.isnan(advantages).any() or torch.isinf(advantages).any():
        raise ValueError("advantages: contains NaN or inf")
    if not delta > 0:
        raise ValueError(f"delta: must be > 0, got {delta}")
    if delta_low is not None and not delta_low > 0:
        raise ValueError(f"delta_low: must be > 0, got {delta_low}")
