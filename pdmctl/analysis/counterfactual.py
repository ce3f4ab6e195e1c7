"""The `counterfactual` protocol: what a criterion's decision on one token does.

For every out-of-region token and every criterion, two real updates from the same start (the stale
learner's weights after the step's first mini-batch updates and its carried Adam state), each one Adam
update on the whole batch with the clip factor of its own gradient norm: one with the token kept and one
with it masked, every other token as the criterion decides. The token's D after
each, and the mean D over the batch's out-of-region tokens after each (the trust region's purpose):

    own_j    = D_j(keep) − D_j(mask)                    (> 0: keeping the token raised its D)
    region_j = mean_out D(keep) − mean_out D(mask)      (> 0: keeping it raised the region's D)

A kept token with own_j > 0 is an unsafe keep; a masked token with own_j < 0 was masked needlessly
(keeping it would have lowered its D).

The criterion's own update is one member of each pair (the keep update for the tokens it keeps, the
mask update for the others); the other member differs in one token's gradient. The loss is linear in
the mask (L = Σ_t α_t M_t log π_{k_t}, the aggregation's weights independent of M, masks.AGGREGATIONS),
so the other member's raw gradient is the criterion's ± α_j ∇θ log π_{k_j}: one per-token gradient per
out-of-region token (shared by the criteria: α_j as if kept does not depend on the mask), then, per
variant, exactly what training does with a gradient: the clipping of `clip_grad_norm_` on its own norm
and a real Adam step (`torch.optim.adam.adam`, the function `Adam.step` calls) from a copy of the
carried state, all variants of a chunk stacked as one [variants, parameters] tensor (Adam is
elementwise). Each variant's own D is read on its token's row only (`own_logits`: the variants of a chunk
in one vmapped forward, beside the criterion's update on the same row so that both members round
alike). The region's mean is first order: one backward of the region's mean D at the criterion's update
(`region_gradient`) times each variant's weights minus the update's; a few variants per seed also take it
exactly (a forward of every out-of-region row), and `exact_region` takes every one so (the full forward
for both D's). Beside the whole-step pair, a clip-held pair: the other member's raw gradient scaled by
the criterion's own update's clip factor, not its own (`Effects.own_clip_held`). |own| below
`SIGN_FLOOR` is within float32 rounding's reach (tests/test_counterfactual.py measures it; a float64
rerun keeps nearly every such sign, bench/sign_floor.py). `counterfactual_effects_reference` takes every update the direct way (a loss with the
token's mask flipped, backward, clipping, `optimizer.step` on a copy of the optimizer) and is what the
batched one is tested against (tests/test_counterfactual.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch.func import functional_call, grad, vmap
from torch.optim.adam import adam as adam_step

from pdmctl import masks
from pdmctl.analysis.decomposition import (
    TokenSupport,
    _math_attention,
    divergence_of_logits,
    loss_coefficients,
    token_support,
)
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import PRECISIONS, forward
from pdmctl.backends.toy.probe import flat_diagnostics
from pdmctl.backends.toy.rollout import Rollout
from pdmctl.backends.toy.trainer import Learner

CHUNK_VARIANTS = 32  # variants stacked per Adam step: [32, parameters] float32 × 4 (param, grad, m, v)
CHUNK_GRADIENTS = 32  # per-token gradients per vmapped pass
# |own| below which float32 rounding can reach a sign: twice the largest |own(float32) − own(float64)| measured
# (tests/test_counterfactual.py, test_signs_agree_above_the_float32_floor, says how), rounded up
SIGN_FLOOR = 2e-5
# variants per criterion whose region effect is also taken exactly, beside its first-order value
REGION_CHECKS = 1


@dataclass(frozen=True)
class Effects:
    """One criterion's counterfactual on the listed out-of-region tokens (float64 [n] each)."""

    kept: torch.Tensor  # bool [n]: the criterion keeps the token
    own: torch.Tensor  # D_j(keep) − D_j(mask)
    region: torch.Tensor  # mean over the listed tokens of D(keep) − D(mask)
    d_keep: torch.Tensor  # D_j after the keep update
    d_mask: torch.Tensor  # D_j after the mask update
    # the region's effect taken exactly (a forward of the whole region) where it was, NaN elsewhere (None: all)
    region_exact: torch.Tensor | None = None
    first_order: bool = False  # `region` by first order (else every one exact)
    # own with the other member's gradient scaled by the criterion's own clipping factor, not its own
    own_clip_held: torch.Tensor | None = None


def _flat_names(policy: torch.nn.Module) -> list[tuple[str, tuple[int, ...], slice]]:
    found, at = [], 0
    for name, p in policy.named_parameters():
        found.append((name, tuple(p.shape), slice(at, at + p.numel())))
        at += p.numel()
    return found


def _unflat(theta: torch.Tensor, layout) -> dict[str, torch.Tensor]:
    return {name: theta[..., sl].reshape(*theta.shape[:-1], *shape) for name, shape, sl in layout}


def _used(params: dict[str, torch.Tensor], cfg: ToyConfig) -> dict[str, torch.Tensor]:
    """The values the training forward uses (model.forward): the masters or straight-through cast weights."""
    cast = PRECISIONS[cfg.precision].train
    if cast is None:
        return params
    return {n: p + (cast(p.detach()) - p).detach() for n, p in params.items()}


def logits_at(
    policy: torch.nn.Module, params: dict[str, torch.Tensor], inputs: torch.Tensor, which: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """The logits [n, V] predicting response position `positions[i]` of sequence `inputs[which[i]]`, under
    `params` (TinyTransformer.forward, the head at the listed positions only)."""
    seq = inputs.shape[1]
    x = torch.nn.functional.embedding(inputs, params["tok.weight"]) + params["pos.weight"][:seq]
    for i, block in enumerate(policy.blocks):
        prefix = f"blocks.{i}."
        x = functional_call(block, {n[len(prefix):]: v for n, v in params.items() if n.startswith(prefix)}, (x,))
    h = x[which, positions]
    h = functional_call(policy.ln_f, {"weight": params["ln_f.weight"], "bias": params["ln_f.bias"]}, (h,))
    z = torch.nn.functional.linear(h, params["head.weight"], params["head.bias"])
    scale = getattr(policy, "logit_scale", None)  # toy-fork's fixed multiplier (None: the other presets)
    return z if scale is None else z * scale


def divergence_at(logits: torch.Tensor, batch: Rollout, rows: torch.Tensor, cols: torch.Tensor, cfg: ToyConfig):
    """D (float64 [n]) of the tokens (rows, cols) from their logits [n, V], as masks computes it."""
    div = masks.DIVERGENCES[cfg.divergence]
    with torch.no_grad():
        s, _ = masks.token_support(
            logits, batch.sampled_ids[rows, cols], batch.topk_ids[rows, cols], batch.topk_logprobs[rows, cols],
            batch.sampled_logprobs[rows, cols], div.support, need_tail_sum_sq=False,
        )  # fmt: skip
        return div.family.divergence(s)


def token_gradients(
    learner: Learner, batch: Rollout, advantages: torch.Tensor, cfg: ToyConfig, rows, cols, chunk=CHUNK_GRADIENTS,
    coordinates: torch.Tensor | None = None,
) -> torch.Tensor:
    """α_j ∇θ log π_{k_j} per listed token [n, P] float32 (flat, `named_parameters` order; only the
    flat `coordinates` if given): the token's part of the raw batch gradient when it is kept (α_j as if
    kept, loss_coefficients)."""
    policy = learner.policy
    layout = _flat_names(policy)
    params = {n: p.detach() for n, p in policy.named_parameters()}
    with torch.no_grad():
        logits = forward(policy, batch.tokens[:, :-1], batch.sampled_ids.shape[1], PRECISIONS[cfg.precision].train)
    dtype = logits.dtype  # the model's (float32; float64 where a test reruns it so)
    alpha = loss_coefficients(logits, batch, advantages, cfg, masked=False)[rows, cols].to(dtype)
    inputs = batch.tokens[:, :-1][rows]
    length = batch.sampled_ids.shape[1]
    ks = batch.sampled_ids[rows, cols]

    at = torch.nn.functional.one_hot(cols, length).to(dtype)

    def log_pi_k(p, tokens, at, k):
        z = (functional_call(policy, _used(p, cfg), (tokens[None], length))[0] * at[:, None]).sum(0)
        return torch.log_softmax(z, -1, dtype=torch.promote_types(z.dtype, torch.float32)).gather(0, k[None])[0]

    per_token = vmap(grad(log_pi_k), in_dims=(None, 0, 0, 0))
    out = torch.empty(len(rows), layout[-1][2].stop if coordinates is None else len(coordinates), dtype=dtype)
    with _math_attention():
        for start in range(0, len(rows), chunk):
            sl = slice(start, start + chunk)
            g = per_token(params, inputs[sl], at[sl], ks[sl])
            flat = torch.cat([g[n].reshape(len(inputs[sl]), -1) for n, _, _ in layout], -1)
            out[sl] = flat if coordinates is None else flat[:, coordinates]
    return out * alpha[:, None]


def raw_gradient(learner: Learner, batch: Rollout, advantages: torch.Tensor, cfg: ToyConfig, keep=None):
    """The raw (unclipped) batch gradient [P] of `cfg`'s loss, with its mask or with `keep` ([B, T] bool)."""
    policy = learner.policy
    resp_mask = learner.task.response_mask(batch.sampled_ids)
    logits = forward(policy, batch.tokens[:, :-1], batch.sampled_ids.shape[1], PRECISIONS[cfg.precision].train)
    loss = loss_with_keep(logits, batch, advantages, resp_mask, cfg, keep)
    learner.optimizer.zero_grad()
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in policy.parameters()])


def loss_with_keep(logits, batch, advantages, resp_mask, cfg, keep=None) -> torch.Tensor:
    """masks.policy_loss (trainer.masked_loss) with the keep mask `keep` [B, T] instead of the criterion's
    (None: the criterion's own, the same numbers as masked_loss)."""
    shape = batch.sampled_ids.shape
    vocab = logits.shape[-1]
    d = flat_diagnostics(logits.detach(), batch, advantages, cfg, method=cfg.method, estimator=cfg.estimator)
    m = d.keep if keep is None else keep.reshape(-1)
    log_pi_k = torch.log_softmax(logits.reshape(-1, vocab), -1, dtype=torch.promote_types(logits.dtype, torch.float32)).gather(
        -1, batch.sampled_ids.reshape(-1, 1)
    ).squeeze(-1)
    a = advantages.unsqueeze(1).expand(shape).reshape(-1)
    weight = a.to(log_pi_k.dtype) * d.ratio.clamp(max=cfg.ratio_cap).to(log_pi_k.dtype) * m.to(log_pi_k.dtype)
    token_loss = (-weight * log_pi_k).reshape(shape)
    return masks.AGGREGATIONS[cfg.loss_agg_mode](token_loss, resp_mask.to(token_loss.dtype))


def _adam_state(learner: Learner, layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """The carried Adam state, flat (copies): exp_avg, exp_avg_sq, step, the hyper-parameters."""
    opt = learner.optimizer
    group = opt.param_groups[0]
    if len(opt.param_groups) != 1 or group["weight_decay"] or group["amsgrad"] or group["maximize"]:
        raise ValueError("counterfactual: one Adam parameter group without weight decay, amsgrad or maximize")
    params = list(learner.policy.parameters())
    states = [opt.state.get(p, {}) for p in params]
    steps = {float(s["step"]) if s else 0.0 for s in states}
    if len(steps) != 1:
        raise ValueError(f"counterfactual: parameters at different Adam steps {sorted(steps)}")
    m = torch.cat([s["exp_avg"].reshape(-1) if s else torch.zeros(p.numel()) for s, p in zip(states, params, strict=True)])
    v = torch.cat([s["exp_avg_sq"].reshape(-1) if s else torch.zeros(p.numel()) for s, p in zip(states, params, strict=True)])
    return m, v, torch.tensor(steps.pop()), group


def clip_coefficients(g: torch.Tensor, layout, max_norm: float, dropped: torch.Tensor | None = None) -> torch.Tensor:
    """clip_grad_norm_'s factor [V] for each row of g [V, P] (from its norm of the per-parameter norms).
    `dropped` [parameters]: the norm of each parameter's coordinates that g leaves out (they count)."""
    norms = torch.stack([torch.linalg.vector_norm(g[:, sl], dim=1) for _, _, sl in layout], 1)
    if dropped is not None:
        norms = torch.hypot(norms, dropped)
    total = torch.linalg.vector_norm(norms, dim=1)
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def clip_rows(g: torch.Tensor, layout, max_norm: float, dropped: torch.Tensor | None = None) -> torch.Tensor:
    """clip_grad_norm_ on each row of g [V, P] (clip_coefficients), a new tensor."""
    return g * clip_coefficients(g, layout, max_norm, dropped)[:, None]


def adam_rows(theta0, g, m0, v0, step0, group) -> torch.Tensor:
    """One real Adam step (torch.optim.adam.adam, Adam.step's function) per row of g [V, P], each from the
    weights theta0 [P] and copies of the state (m0, v0, step0), which stay as they were. [V, P]."""
    n = g.shape[0]
    theta = theta0.expand(n, -1).clone()
    m, v, step = m0.expand(n, -1).clone(), v0.expand(n, -1).clone(), step0.clone()
    adam_step(
        [theta], [g], [m], [v], [], [step], foreach=False, capturable=False, differentiable=False, fused=None,
        amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"], weight_decay=0.0,
        eps=group["eps"], maximize=False,
    )  # fmt: skip
    return theta


def _read_coordinates(layout, inputs: torch.Tensor, vocab: int, whole: bool = False):
    """The flat coordinates the evaluation forward reads (every parameter but the token-embedding rows of
    ids absent from `inputs`; no token's gradient touches those either), their layout, and `inputs` in
    the compacted embedding's ids. `whole`: every coordinate (a cast weight, fp8's, takes its scale from
    the whole tensor)."""
    used = torch.arange(vocab) if whole else torch.unique(inputs)
    parts, compact, at = [], [], 0
    for name, shape, sl in layout:
        if name == "tok.weight":
            width = shape[1]
            flat = (sl.start + used[:, None] * width + torch.arange(width)).reshape(-1)
            shape = (len(used), width)
        else:
            flat = torch.arange(sl.start, sl.stop)
        parts.append(flat)
        compact.append((name, shape, slice(at, at + flat.numel())))
        at += flat.numel()
    remap = torch.full((vocab,), -1, dtype=torch.long)
    remap[used] = torch.arange(len(used))
    return torch.cat(parts), compact, remap[inputs]


def own_logits(policy: torch.nn.Module, compact, theta: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor,
               cfg: ToyConfig) -> torch.Tensor:
    """The logits [V, vocab] predicting position `positions[v]` of the one sequence `inputs[v]` under the
    weights `theta[v]` (flat over `compact`'s coordinates): each variant's forward on its own token's row
    only, all variants in one vmapped pass (the model's forward, attention written out)."""
    seq = inputs.shape[1]
    scale = getattr(policy, "logit_scale", None)

    def one(t: torch.Tensor, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        params = _used(_unflat(t, compact), cfg)
        x = (torch.nn.functional.embedding(tokens, params["tok.weight"]) + params["pos.weight"][:seq])[None]
        for i, block in enumerate(policy.blocks):
            prefix = f"blocks.{i}."
            x = functional_call(block, {n[len(prefix):]: v for n, v in params.items() if n.startswith(prefix)}, (x,))
        h = (x[0] * (torch.arange(seq) == position).to(x.dtype)[:, None]).sum(0)  # the row at `position`, exactly
        h = functional_call(policy.ln_f, {"weight": params["ln_f.weight"], "bias": params["ln_f.bias"]}, (h,))
        z = torch.nn.functional.linear(h, params["head.weight"], params["head.bias"])
        return z if scale is None else z * scale

    with torch.no_grad(), _math_attention():
        return vmap(one)(theta, inputs, positions)


def region_gradient(
    policy: torch.nn.Module, compact, theta: torch.Tensor, inputs, which, positions, support: TokenSupport,
    cfg: ToyConfig,
) -> torch.Tensor:
    """∇θ of the mean D over the listed tokens at the weights `theta` (flat over `compact`), float64 [P]:
    one forward of their rows and one backward, D as decomposition.divergence_of_logits takes it
    (differentiable; the cast weights' gradient straight through, as training's), `support` the tokens'
    (decomposition.token_support)."""
    t = theta.detach().clone().requires_grad_(True)

    def one(z, ids, valid, is_k, log_mu, unseen):
        return divergence_of_logits(z, ids, valid, is_k, log_mu, unseen, cfg.divergence)

    with torch.enable_grad():
        z = logits_at(policy, _used(_unflat(t, compact), cfg), inputs, which, positions)
        s = support
        d = vmap(one)(z, s.ids, s.valid, s.is_k, s.log_mu, s.unseen)
        (g,) = torch.autograd.grad(d.mean(), t)
    return g.double()


def counterfactual_effects(
    learner: Learner,
    batch: Rollout,
    advantages: torch.Tensor,
    criteria: dict[str, ToyConfig],
    rows: torch.Tensor,
    cols: torch.Tensor,
    *,
    variants: torch.Tensor | None = None,
    chunk: int = CHUNK_VARIANTS,
    exact_region: bool = False,
    checks: int = REGION_CHECKS,
    generator: torch.Generator | None = None,
) -> dict[str, Effects]:
    """Each criterion's counterfactual (`Effects`) on the out-of-region tokens (rows, cols), from the
    learner's weights and optimizer state, which are left as they were. `variants` (bool [n]): the
    tokens whose pairs are taken (None: all); the effects of the others are NaN.

    Each variant's own D is read on its own token's row (`own_logits`, the variants of a chunk in one
    vmapped pass, each beside the criterion's update on the same row so that both members round alike).
    The region's mean effect is first order: ∇θ mean_out D at the criterion's update (`region_gradient`,
    one backward) times each variant's weights minus the update's, a product per variant; on `checks`
    variants per criterion drawn by `generator` it is also taken exactly (a forward of every out-of-region
    row at the variant's weights: `Effects.region_exact`). `exact_region`: every variant the exact way
    (the full forward for both D's, at about ten times the CPU; region_exact then equals region), as with
    cast training weights (fp8_e2e), under which D is piecewise constant in the master weights and has no
    first order."""
    policy = learner.policy
    layout = _flat_names(policy)
    any_cfg = next(iter(criteria.values()))
    theta0 = torch.cat([p.detach().reshape(-1) for p in policy.parameters()])
    m0, v0, step0, group = _adam_state(learner, layout)
    uniq, which = torch.unique(rows, return_inverse=True)
    inputs = batch.tokens[:, :-1][uniq]
    positions = inputs.shape[1] - batch.sampled_ids.shape[1] + cols
    # the variants are laid out over the coordinates the evaluation reads only (toy-small: 56% of them)
    coords, compact, inputs = _read_coordinates(
        layout, inputs, policy.head.out_features, whole=PRECISIONS[any_cfg.precision].train is not None
    )
    theta0, m0, v0 = theta0[coords], m0[coords], v0[coords]
    sel = torch.arange(len(rows)) if variants is None else variants.nonzero().squeeze(1)
    contributions = token_gradients(learner, batch, advantages, any_cfg, rows[sel], cols[sel], coordinates=coords)
    active = (contributions != 0).any(1).nonzero().squeeze(1)  # into sel
    outside = torch.ones(layout[-1][2].stop, dtype=torch.bool)
    outside[coords] = False
    rng = generator if generator is not None else torch.Generator().manual_seed(0)
    exact_region = exact_region or PRECISIONS[any_cfg.precision].train is not None

    def d_after(theta: torch.Tensor, cfg: ToyConfig) -> torch.Tensor:  # [V, n]: every listed token's D
        out = []
        with torch.no_grad():
            for t in theta:
                z = logits_at(policy, _used(_unflat(t, compact), cfg), inputs, which, positions)
                out.append(divergence_at(z, batch, rows, cols, cfg))
        return torch.stack(out)

    def d_own(theta: torch.Tensor, idx: torch.Tensor, cfg: ToyConfig) -> torch.Tensor:  # [V]: token idx[v]'s D
        z = own_logits(policy, compact, theta, inputs[which[idx]], positions[idx], cfg)
        return divergence_at(z, batch, rows[idx], cols[idx], cfg)

    found: dict[str, Effects] = {}
    done: dict[bytes, Effects] = {}  # criteria with the same mask on the batch take the same updates
    # one forward for every criterion (a criterion changes the loss's mask, not the logits), a backward each
    resp_mask = learner.task.response_mask(batch.sampled_ids)
    logits = forward(policy, batch.tokens[:, :-1], batch.sampled_ids.shape[1], PRECISIONS[any_cfg.precision].train)
    supports: dict[str, TokenSupport] = {}  # the tokens' supports, per divergence (region_gradient)
    for name, cfg in criteria.items():
        if cfg.precision != any_cfg.precision or cfg.loss_agg_mode != any_cfg.loss_agg_mode:
            raise ValueError("counterfactual: the criteria share one precision and one aggregation")
        with torch.no_grad():
            keep = flat_diagnostics(logits.detach(), batch, advantages, cfg, method=cfg.method, estimator=cfg.estimator).keep
        key = keep.numpy().tobytes() + repr((cfg.grad_clip, cfg.ratio_cap, cfg.divergence)).encode()
        if key in done:
            found[name] = done[key]
            continue
        # the raw batch gradient, as raw_gradient takes it
        loss = loss_with_keep(logits, batch, advantages, resp_mask, cfg)
        full = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(policy.parameters()), retain_graph=True)])
        dropped = torch.stack([torch.linalg.vector_norm(full[sl][outside[sl]]) for _, _, sl in layout])
        base = full[coords]

        def update(g: torch.Tensor, clip: float = cfg.grad_clip, dropped: torch.Tensor = dropped) -> torch.Tensor:
            return adam_rows(theta0, clip_rows(g, compact, clip, dropped), m0, v0, step0, group)

        # the clip-held channel: the other member's raw gradient scaled by the criterion's own clipping factor
        held = clip_coefficients(base[None], compact, cfg.grad_clip, dropped)

        def update_held(g: torch.Tensor, held: torch.Tensor = held) -> torch.Tensor:
            return adam_rows(theta0, g * held[:, None], m0, v0, step0, group)

        kept = keep.view(batch.sampled_ids.shape)[rows, cols]
        sign = torch.where(kept, -1.0, 1.0)  # the other member: the kept token masked, the masked one kept
        theta_base = update(base[None])
        held_sel = torch.zeros(len(sel), dtype=torch.float64)

        n_sel = len(sel)
        # a token with α = 0 (A = 0) adds nothing to the gradient: both members are the criterion's update
        d_base_own = torch.empty(n_sel, dtype=torch.float64)  # D after the criterion's update
        d_other_own = torch.empty(n_sel, dtype=torch.float64)  # D after the other member
        own_sel = torch.zeros(n_sel, dtype=torch.float64)
        region_sel = torch.zeros(n_sel, dtype=torch.float64)
        exact_sel = torch.full((n_sel,), torch.nan, dtype=torch.float64)
        if exact_region:  # every variant's D over the whole region: the full forward at its weights
            d_base_all = d_after(theta_base, cfg)[0]
            d_base_own[:] = d_other_own[:] = d_base_all[sel]
            for start in range(0, len(active), chunk):
                sl = active[start : start + chunk]
                g = base[None] + sign[sel[sl], None] * contributions[sl]
                d_all = d_after(update(g), cfg)
                s = sign[sel[sl]].double()
                # the clip-held pairs, each on its token's own row
                pair = d_own(torch.cat([update_held(g), theta_base.expand(len(sl), -1)]), sel[sl].repeat(2), cfg)
                held_sel[sl] = s * (pair[: len(sl)] - pair[len(sl) :])
                d_other_own[sl] = d_all[torch.arange(len(sl)), sel[sl]]
                own_sel[sl] = s * (d_other_own[sl] - d_base_own[sl])
                region_sel[sl] = s * (d_all - d_base_all[None]).mean(1)
            exact_sel[:] = region_sel
        else:
            if cfg.divergence not in supports:
                kind = masks.DIVERGENCES[cfg.divergence].support
                supports[cfg.divergence] = token_support(batch, rows, cols, kind, policy.head.out_features)
            grad_region = region_gradient(policy, compact, theta_base[0], inputs, which, positions,
                                          supports[cfg.divergence], cfg)  # fmt: skip
            idle = torch.ones(n_sel, dtype=torch.bool)
            idle[active] = False
            idle = idle.nonzero().squeeze(1)
            for start in range(0, len(idle), chunk):  # the criterion's update on each token's own row
                sl = idle[start : start + chunk]
                d_base_own[sl] = d_other_own[sl] = d_own(theta_base.expand(len(sl), -1), sel[sl], cfg)
            for start in range(0, len(active), chunk):
                sl = active[start : start + chunk]
                g = base[None] + sign[sel[sl], None] * contributions[sl]
                theta, k = update(g), len(sl)
                # the variant, its clip-held twin and the criterion's update, each on the token's own row
                trio = d_own(torch.cat([theta, update_held(g), theta_base.expand(k, -1)]), sel[sl].repeat(3), cfg)
                s = sign[sel[sl]].double()
                d_base_own[sl], d_other_own[sl] = trio[2 * k :], trio[:k]
                held_sel[sl] = s * (trio[k : 2 * k] - trio[2 * k :])
                own_sel[sl] = s * (d_other_own[sl] - d_base_own[sl])
                region_sel[sl] = s * ((theta - theta_base).double() @ grad_region)
            picked = active[torch.randperm(len(active), generator=rng)[:checks]]
            if len(picked):  # the first order against the exact value, on a few variants
                d_base_all = d_after(theta_base, cfg)[0]
                d_all = d_after(update(base[None] + sign[sel[picked], None] * contributions[picked]), cfg)
                exact_sel[picked] = sign[sel[picked]].double() * (d_all - d_base_all[None]).mean(1)
        own, region, region_exact, at_keep, at_mask, own_clip_held = (
            torch.full((len(rows),), torch.nan, dtype=torch.float64) for _ in range(6)
        )
        own[sel], region[sel], region_exact[sel], own_clip_held[sel] = own_sel, region_sel, exact_sel, held_sel
        at_keep[sel] = torch.where(kept[sel], d_base_own, d_other_own)
        at_mask[sel] = torch.where(kept[sel], d_other_own, d_base_own)
        found[name] = done[key] = Effects(
            kept=kept, own=own, region=region, d_keep=at_keep, d_mask=at_mask, region_exact=region_exact,
            first_order=not exact_region, own_clip_held=own_clip_held,
        )  # fmt: skip
    del logits
    for p in policy.parameters():
        p.grad = None
    return found


def counterfactual_effects_reference(
    learner: Learner,
    batch: Rollout,
    advantages: torch.Tensor,
    criteria: dict[str, ToyConfig],
    rows: torch.Tensor,
    cols: torch.Tensor,
    tokens: list[int] | None = None,
    clip_held: bool = False,
) -> dict[str, Effects]:
    """`counterfactual_effects` the direct way (tests): for each listed token (`tokens`: indices into rows,
    cols; None: all) two whole updates from the learner's weights and a deep copy of its optimizer — the
    loss with the token kept, backward, clip_grad_norm_, optimizer.step — and D read by the model's own
    forward. `clip_held`: the gradients scaled by the criterion's own update's clipping factor instead of
    clip_grad_norm_ on their own norm (`Effects.own_clip_held`'s pairs). The learner is left as it was."""
    policy = learner.policy
    weights = copy.deepcopy(policy.state_dict())
    optimizer_state = copy.deepcopy(learner.optimizer.state_dict())
    shape = batch.sampled_ids.shape
    uniq, which = torch.unique(rows, return_inverse=True)
    sub = batch.select(uniq)
    picked = list(range(len(rows))) if tokens is None else list(tokens)

    def d_now(cfg: ToyConfig) -> torch.Tensor:
        with torch.no_grad():
            logits = forward(policy, sub.tokens[:, :-1], shape[1], PRECISIONS[cfg.precision].train)
        return divergence_at(logits[which, cols], batch, rows, cols, cfg)

    found = {}
    for name, cfg in criteria.items():
        policy.load_state_dict(weights)
        with torch.no_grad():
            logits = forward(policy, batch.tokens[:, :-1], shape[1], PRECISIONS[cfg.precision].train)
        keep = flat_diagnostics(logits, batch, advantages, cfg, method=cfg.method, estimator=cfg.estimator).keep
        keep = keep.view(shape)
        resp_mask = learner.task.response_mask(batch.sampled_ids)
        learner.optimizer.zero_grad()
        loss_with_keep(forward(policy, batch.tokens[:, :-1], shape[1], PRECISIONS[cfg.precision].train), batch,
                       advantages, resp_mask, cfg).backward()  # fmt: skip
        norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), float("inf")))  # the criterion's own
        factor = min(1.0, cfg.grad_clip / (norm + 1e-6))
        after: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        for j in picked:
            for kept_j in (True, False):
                policy.load_state_dict(weights)
                optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
                optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # the snapshot never moves
                mask = keep.clone()
                mask[rows[j], cols[j]] = kept_j
                resp_mask = learner.task.response_mask(batch.sampled_ids)
                z = forward(policy, batch.tokens[:, :-1], shape[1], PRECISIONS[cfg.precision].train)
                loss = loss_with_keep(z, batch, advantages, resp_mask, cfg, mask)
                optimizer.zero_grad()
                loss.backward()
                if clip_held:
                    for p in policy.parameters():
                        p.grad.mul_(factor)
                else:
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
                optimizer.step()
                after[kept_j].append(d_now(cfg))
        d_keep, d_mask = torch.stack(after[True]), torch.stack(after[False])  # [picked, n]
        idx = torch.tensor(picked, dtype=torch.long)
        ar = torch.arange(len(picked))
        found[name] = Effects(
            kept=keep[rows, cols][idx],
            own=d_keep[ar, idx] - d_mask[ar, idx],
            region=(d_keep - d_mask).mean(1),
            d_keep=d_keep[ar, idx],
            d_mask=d_mask[ar, idx],
        )
    policy.load_state_dict(weights)
    learner.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
    for p in policy.parameters():
        p.grad = None
    return found
