"""ΔD decomposed per seed (the pieces of `decomposition.py`, on the out-of-region tokens), and the
summary rows over seeds: the decomposition and the predictive criterion's logit-space assumption."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmctl import masks
from pdmctl.analysis import decomposition
from pdmctl.analysis.results import AssumptionRow, DecompositionRow
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import PRECISIONS, forward
from pdmctl.backends.toy.rollout import Rollout
from pdmctl.backends.toy.trainer import Learner

PIECES = ("realized", "first_order", "own", "others", "momentum", "own_logit", "own_head")


@dataclass(frozen=True)
class _SeedDecomposition:
    """One seed's decomposition: per (protocol, criterion) the PIECES over the out-of-region tokens with
    A ≠ 0 that the criterion keeps; `assumption`: the own effects over all of them (as if kept)."""

    by_update: dict[tuple[str, str], dict[str, torch.Tensor]]
    assumption: dict[str, torch.Tensor]


def _decompose_seed(
    learner: Learner,
    cfg: ToyConfig,
    batch: Rollout,
    advantages: torch.Tensor,
    pre: dict[str, masks.Diagnostics],
    outside: torch.Tensor,
    criteria: dict[str, ToyConfig],
    parts: dict[tuple[str, str], decomposition.UpdateParts],
    delta: dict[tuple[str, str], torch.Tensor],
    *,
    reference: bool = False,
) -> _SeedDecomposition:
    """Per-token ΔD pieces at the learner's (start) weights; also fills `delta` for the own-effect
    protocols: ΔD of a kept token = its own effect, first order (zero on the tokens a criterion masks)."""
    a = advantages.unsqueeze(1).expand_as(outside)
    rows, cols = (outside & (a != 0)).nonzero(as_tuple=True)
    with torch.no_grad():
        logits = forward(
            learner.policy, batch.tokens[:, :-1], batch.sampled_ids.shape[1], PRECISIONS[cfg.precision].train
        )
    keys = list(parts)
    vectors = torch.stack(
        [v for k in keys for v in (parts[k].step, parts[k].momentum, parts[k].gain * parts[k].grad)], dim=1
    )
    n_params = vectors.shape[0]
    gains = torch.stack([parts[k].gain.expand(n_params) for k in keys], dim=1)
    token_products = decomposition.token_products_reference if reference else decomposition.token_products
    products = token_products(learner.policy, cfg, batch, rows, cols, vectors, gains)
    support = decomposition.token_support(
        batch, rows, cols, masks.DIVERGENCES[cfg.divergence].support, logits.shape[-1]
    )
    ddot_logit = decomposition.logit_ddot(logits[rows, cols], support, cfg.divergence)
    alpha = {
        n: decomposition.loss_coefficients(logits, batch, advantages, c)[rows, cols]
        for n, c in criteria.items()
    }
    by_update: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for i, key in enumerate(keys):
        p, coef = parts[key], alpha[key[1]]
        own = p.clip * coef * products.own[:, i]
        kept = coef != 0
        pieces = {
            "realized": delta[key][rows, cols].double(),
            "first_order": products.dot[:, 3 * i],
            "own": own,
            "others": products.dot[:, 3 * i + 2] - own,
            "momentum": products.dot[:, 3 * i + 1],
            "own_logit": -p.clip * coef * ddot_logit,
            "own_head": p.clip * coef * products.own_head[:, i],
        }
        by_update[key] = {name: v[kept] for name, v in pieces.items()}
    for name in criteria:
        carried = parts["carried", name]
        coef = alpha[name]
        own_adam = carried.clip * coef * products.own[:, keys.index(("carried", name))]
        own_grad = -cfg.lr * carried.clip * coef * products.plain
        for protocol, own in (("own-adam", own_adam), ("own-grad", own_grad)):
            full = torch.zeros(outside.shape, dtype=torch.float64)
            full[rows, cols] = own
            delta[protocol, name] = full
    unmasked = decomposition.loss_coefficients(logits, batch, advantages, criteria["ratio"], masked=False)
    coef = unmasked[rows, cols]
    i_adam = keys.index(("carried", "ratio"))
    assumption = {
        "logit": -coef * ddot_logit,
        "plain": -coef * products.plain,
        "plain_head": -coef * products.plain_head,
        "adam": coef * products.own[:, i_adam],
        "adam_head": coef * products.own_head[:, i_adam],
        "exact": (a[rows, cols] * pre["exact"].ddot[rows, cols]).double(),
        "ratio": (a[rows, cols] * (pre["agg"].ratio[rows, cols] - 1)).double(),
        "divergence_check": products.divergence - pre["agg"].divergence[rows, cols].double(),
    }
    return _SeedDecomposition(by_update, assumption)


def _median(x: torch.Tensor) -> float | None:
    x = x[torch.isfinite(x)]
    return float(x.median()) if x.numel() else None


def _agreement(piece: torch.Tensor, reference: torch.Tensor) -> float | None:
    """Share of tokens where piece and reference have the same sign (None where the piece is all zero)."""
    if not piece.numel() or not bool((piece != 0).any()):
        return None
    return float((torch.sign(piece) == torch.sign(reference)).double().mean())


def _shares(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    total = p["own"].abs() + p["others"].abs() + p["momentum"].abs()
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return {name: p[name].abs() / safe for name in ("own", "others", "momentum")}


def _head_share(total: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    whole = head.abs() + (total - head).abs()
    return head.abs() / torch.where(whole > 0, whole, torch.ones_like(whole))


def _decomposition_rows(seeds: list[_SeedDecomposition]) -> list[DecompositionRow]:
    if not seeds:
        return []
    rows = []
    for protocol, criterion in seeds[0].by_update:
        per_seed = [s.by_update[protocol, criterion] for s in seeds]
        pooled = {name: torch.cat([p[name] for p in per_seed]) for name in PIECES}
        shares = _shares(pooled)
        seed_shares = [_shares(p) for p in per_seed]
        realized = pooled["realized"]
        error = (realized - pooled["first_order"]).abs() / realized.abs()
        rows.append(
            DecompositionRow(
                protocol=protocol,
                criterion=criterion,
                tokens=int(realized.numel()),
                own_share=_median(shares["own"]),
                others_share=_median(shares["others"]),
                momentum_share=_median(shares["momentum"]),
                first_order_sign=_agreement(pooled["first_order"], realized),
                own_sign=_agreement(pooled["own"], realized),
                others_sign=_agreement(pooled["others"], realized),
                momentum_sign=_agreement(pooled["momentum"], realized),
                own_logit_sign=_agreement(pooled["own_logit"], realized),
                own_last_layer_share=_median(_head_share(pooled["own"], pooled["own_head"])),
                first_order_error=_median(error),
                own_share_per_seed=[_median(s["own"]) for s in seed_shares],
                others_share_per_seed=[_median(s["others"]) for s in seed_shares],
                momentum_share_per_seed=[_median(s["momentum"]) for s in seed_shares],
            )
        )
    return rows


ASSUMPTION_KINDS = (  # (row name, own effect, its head part or None)
    ("logit space, along e_k − π (the criterion's assumption)", "logit", None),
    ("last layer only, plain gradient", "plain_head", None),
    ("whole network, plain gradient", "plain", "plain_head"),
    ("whole network, carried Adam's gain", "adam", "adam_head"),
)


def _assumption_rows(seeds: list[_SeedDecomposition]) -> list[AssumptionRow]:
    if not seeds:
        return []
    pooled = {name: torch.cat([s.assumption[name] for s in seeds]) for name in seeds[0].assumption}
    return [
        AssumptionRow(
            own_effect=label,
            tokens=int(pooled[name].numel()),
            agrees_exact=_agreement(pooled[name], pooled["exact"]),
            agrees_ratio=_agreement(pooled[name], pooled["ratio"]),
            last_layer_share=_median(_head_share(pooled[name], pooled[head])) if head else None,
        )
        for label, name, head in ASSUMPTION_KINDS
    ]
