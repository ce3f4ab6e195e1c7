"""ΔD decomposed, per out-of-region token (docs/MATH.md, "ΔD decomposed").

Every update the analysis takes is, exactly, `Δθ = m + K ⊙ g`: `g` the clipped batch gradient,
`m` the carried momentum's part and `K` a per-coordinate gain. For Adam at step `s` (torch's
update, no weight decay), with `P = lr / (bc1 (sqrt(v_s / bc2) + ε))`, `m = −P β1 m_{s−1}` and
`K = −P (1 − β1)` (a fresh Adam: `m_0 = 0`, so `m = 0`); for the `sgd` protocol `m = 0` and `K`
is the scalar `−scale`. The clipped gradient is `g = c Σ_t α_t ∇θ log π_{k_t}`, `c` the clipping
factor and `α_t = ∂L/∂ log π_{k_t}` (the mask, the ratio and the aggregation in one number). So the
first-order ΔD of token j, `∇θ D_j · Δθ`, splits into

- own: `∇θ D_j · (K ⊙ c α_j ∇θ log π_{k_j})`, the token's own gradient through the update's gain;
- others: `∇θ D_j · (K ⊙ g) − own`, every other token's gradient;
- momentum: `∇θ D_j · m`;

and they sum to `∇θ D_j · (m + K ⊙ g)`, the first-order prediction along the realized step up to
the float32 rounding of the weights. The predictive criterion assumes the own effect is the logit
step `−c α_j (e_k − π)` at the token's own position (`own_logit`, whose sign is `sign(A·Ḋ_exact)`);
through the network it is `∇θ D_j · ∇θ log π_{k_j}` (plain) or that with Adam's gain in between.

Per-token gradients are taken for the out-of-region tokens only and used only through dot products
with the few update vectors: nothing of size [tokens, parameters] is kept. `token_products` splits
the network at its ends: the head's gradient is rank one (∂f/∂z ⊗ u), the token embedding's is the
gradient at the embedded input, and only the blocks and the final norm get a per-token gradient
(torch.func: vmap over tokens of a vector-jacobian product, one sequence each). The direct way, the
whole jacobian of `(D_j, log π_{k_j})` over every parameter (`token_products_reference`), gives the
same numbers to float32 rounding (tests/test_toy_decomposition.py) at 6× the CPU on toy-small
(its 4,096-token vocabulary: 192 tokens, one thread, 1.77 s against 0.29 s) and 1.4× on toy-llm's 512.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call, grad_and_value, jacrev, jvp, vjp, vmap

from pdmctl import masks
from pdmctl.backends.toy import task
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import PRECISIONS
from pdmctl.backends.toy.probe import flat_diagnostics
from pdmctl.backends.toy.rollout import Rollout

CHUNK_TOKENS = 256  # tokens per vmapped pass: [256, 2, the blocks' parameters] of float32 scratch
HEAD = "head."  # the last layer: the vocabulary head's weight and bias


@dataclass(frozen=True)
class UpdateParts:
    """One update as `step ≈ momentum + gain ⊙ grad` (float64, flat over the parameters)."""

    step: torch.Tensor  # the realized Δθ: weights after minus weights before
    momentum: torch.Tensor  # m: the carried optimizer state's part (zeros without one)
    gain: torch.Tensor  # K: per coordinate (Adam) or a 0-dim scalar (sgd)
    grad: torch.Tensor  # g: the clipped batch gradient
    clip: float  # c: the clipping factor g = c · (the raw gradient)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def clip_factor(grad_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6))."""
    return min(1.0, max_norm / (grad_norm + 1e-6))


def update_parts(
    params: Sequence[torch.nn.Parameter],
    theta0: torch.Tensor,
    start_optimizer: dict,
    criterion: ToyConfig,
    protocol: str,
    grad_norm: float,
) -> UpdateParts:
    """The parts of the update `take_update` has just taken (the parameters hold its result and its
    clipped gradient in `.grad`), from the optimizer state it started from."""
    step = flat(params) - theta0
    grad = flat(p.grad for p in params)
    clip = clip_factor(grad_norm, criterion.grad_clip)
    if protocol == "sgd":  # Δθ = −scale · g, scale = |Δθ| / |g|
        norm = torch.linalg.vector_norm(grad)
        scale = torch.linalg.vector_norm(step) / norm if norm > 0 else torch.zeros((), dtype=torch.float64)
        return UpdateParts(step, torch.zeros_like(step), -scale, grad, clip)
    if protocol == "carried":
        group = start_optimizer["param_groups"][0]
        states = [start_optimizer["state"].get(i, {}) for i in range(len(params))]
    else:  # fresh-adam: torch's defaults at the criterion's learning rate, no state
        group = {**torch.optim.Adam([torch.zeros(1)], lr=criterion.lr).defaults}
        states = [{} for _ in params]
    if group.get("weight_decay", 0) or group.get("amsgrad") or group.get("maximize"):
        raise ValueError("update_parts: Adam without weight decay, amsgrad or maximize only")
    beta1, beta2 = group["betas"]
    steps = {int(s["step"]) if s else 0 for s in states}
    if len(steps) != 1:
        raise ValueError(f"update_parts: parameters at different Adam steps {sorted(steps)}")
    s = steps.pop() + 1

    def state(name: str) -> torch.Tensor:
        return torch.cat(
            [
                st[name].reshape(-1).double() if st else torch.zeros(p.numel(), dtype=torch.float64)
                for st, p in zip(states, params, strict=True)
            ]
        )

    m_prev, v_prev = state("exp_avg"), state("exp_avg_sq")
    v = beta2 * v_prev + (1 - beta2) * grad * grad
    denom = v.sqrt() / math.sqrt(1 - beta2**s) + group["eps"]
    precondition = group["lr"] / (1 - beta1**s) / denom
    return UpdateParts(step, -precondition * beta1 * m_prev, -precondition * (1 - beta1), grad, clip)


def loss_coefficients(
    logits: torch.Tensor,
    batch: Rollout,
    advantages: torch.Tensor,
    criterion: ToyConfig,
    *,
    masked: bool = True,
) -> torch.Tensor:
    """α = ∂L/∂ log π_k per token [B, T] for `criterion`'s loss (masks.policy_loss): −A·min(r, C)·M times
    the aggregation's weight; with `masked=False` as if every token were kept (M = 1)."""
    shape = batch.sampled_ids.shape
    d = flat_diagnostics(logits, batch, advantages, criterion, method=criterion.method, estimator=criterion.estimator)
    keep = d.keep.float() if masked else torch.ones_like(d.ratio)
    weight = advantages.unsqueeze(1).expand(shape).reshape(-1).float() * d.ratio.clamp(
        max=criterion.ratio_cap
    )
    weight = (weight * keep).view(shape).double()
    x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)  # the aggregation is linear in x
    masks.AGGREGATIONS[criterion.loss_agg_mode](x, task.response_mask(batch.sampled_ids).double()).backward()
    return -weight * x.grad


@dataclass(frozen=True)
class TokenSupport:
    """What D of one token needs besides its logits, for a list of tokens (leading dim n)."""

    ids: torch.Tensor  # long [n, m]
    valid: torch.Tensor  # bool [n, m]
    is_k: torch.Tensor  # bool [n, m]
    log_mu: torch.Tensor  # float64 [n, m] (0 where not valid)
    unseen: torch.Tensor  # float64 [n, V]: 1 off the support
    k: torch.Tensor  # long [n]


def token_support(
    batch: Rollout, rows: torch.Tensor, cols: torch.Tensor, kind: str, vocab: int
) -> TokenSupport:
    """The support S of each listed token, laid out as masks.token_support lays it out."""
    k = batch.sampled_ids[rows, cols]
    k_col = k.unsqueeze(-1)
    lp_k = batch.sampled_logprobs[rows, cols].unsqueeze(-1).double()
    if kind == "binary":
        ids, log_mu, valid = k_col, lp_k, torch.ones_like(k_col, dtype=torch.bool)
    else:
        topk_ids, topk_lp = batch.topk_ids[rows, cols], batch.topk_logprobs[rows, cols]
        valid_topk = torch.isfinite(topk_lp)
        k_in = ((topk_ids == k_col) & valid_topk).any(-1, keepdim=True)
        ids = torch.cat([torch.where(valid_topk, topk_ids, 0), k_col], dim=-1)
        log_mu = torch.cat([topk_lp.double(), lp_k], dim=-1)
        valid = torch.cat([valid_topk, ~k_in], dim=-1)
    named = valid.clone()
    named[:, -1] = True
    on_support = ((ids.unsqueeze(-1) == torch.arange(vocab)) & named.unsqueeze(-1)).any(1)
    return TokenSupport(
        ids=ids,
        valid=valid,
        is_k=valid & (ids == k_col),
        log_mu=torch.where(valid, log_mu, torch.zeros((), dtype=torch.float64)),
        unseen=(~on_support).double(),
        k=k,
    )


def divergence_of_logits(z: torch.Tensor, ids, valid, is_k, log_mu, unseen, divergence: str) -> torch.Tensor:
    """D of one token from its logits z [V] (float64 throughout, differentiable, vmap-able): the family's
    own formula (masks) on a support built as masks.token_support builds it, the tail summed directly."""
    zero = torch.zeros((), dtype=torch.float64)
    log_p = torch.log_softmax(z.double(), dim=-1)
    log_pi_all = log_p.gather(0, ids)
    log_pi = torch.where(valid, log_pi_all, zero)
    pi = torch.where(valid, log_pi.exp(), zero)
    mu = torch.where(valid, log_mu.exp(), zero)
    support = masks.Support(
        valid=valid[None],
        is_k=is_k[None],
        pi=pi[None],
        mu=mu[None],
        log_pi=log_pi[None],
        log_mu=log_mu[None],
        log_pi_k=log_pi_all[-1:],
        pi_k=log_pi_all[-1:].exp(),
        mu_k=(mu * is_k).sum(-1, keepdim=True),
        pi_tail=(log_p.exp() * unseen).sum(-1, keepdim=True).clamp_min(masks.EPS),
        mu_tail=(1.0 - mu.sum(-1, keepdim=True)).clamp_min(masks.EPS),
        n_minus_m=(unseen.shape[-1] - valid.sum(-1, keepdim=True)).clamp_min(1).double(),
    )
    return masks.DIVERGENCES[divergence].family.divergence(support)[0]


def logit_ddot(logits_at: torch.Tensor, support: TokenSupport, divergence: str) -> torch.Tensor:
    """d/dη D(z + η (e_k − π)) at η = 0 per token, by forward-mode autograd on the logits [n, V]: the
    derivative the predictive criterion's Ḋ_exact stands for."""

    def one(z, ids, valid, is_k, log_mu, unseen, k):
        z = z.double()
        direction = torch.nn.functional.one_hot(k, z.shape[-1]).double() - torch.softmax(z, -1)
        return jvp(lambda x: divergence_of_logits(x, ids, valid, is_k, log_mu, unseen, divergence), (z,),
                   (direction,))[1]  # fmt: skip

    s = support
    return vmap(one)(logits_at, s.ids, s.valid, s.is_k, s.log_mu, s.unseen, s.k)


@dataclass(frozen=True)
class TokenProducts:
    """Per listed token: ∇D · each vector, and ∇D ⊙ ∇log π_k summed against each gain (whole network
    and the head alone). float64."""

    dot: torch.Tensor  # [n, vectors]
    own: torch.Tensor  # [n, gains]: Σ_θ ∇D ⊙ gain ⊙ ∇log π_k
    own_head: torch.Tensor  # [n, gains]: the same over the head's parameters only
    plain: torch.Tensor  # [n]: ∇D · ∇log π_k
    plain_head: torch.Tensor  # [n]
    divergence: torch.Tensor  # [n]: D at the weights (to check against the analysis's)


def token_products(
    policy: torch.nn.Module,
    cfg: ToyConfig,
    batch: Rollout,
    rows: torch.Tensor,
    cols: torch.Tensor,
    vectors: torch.Tensor,
    gains: torch.Tensor,
    chunk: int = CHUNK_TOKENS,
) -> TokenProducts:
    """Per-token gradients of D and log π_k at the policy's weights for the tokens (rows, cols), used
    only through products with `vectors` [P, a] and `gains` [P, b] (P: the flat parameters, in
    `named_parameters` order).

    The gradients are never laid out over the whole network. The logits are z = W u + b, u the final
    layer norm's output at the token's position, so the head's gradients are rank one (∂f/∂z ⊗ u and
    ∂f/∂z); the token embedding's gradient is the gradient at the embedded input x0 = E[tokens] + P,
    scattered to the sequence's rows. Only the blocks' and the final norm's parameters (and x0) get a
    per-token gradient, one vector-jacobian product of u per token and function (vmapped): the same
    numbers as the whole jacobian, with the vocabulary-sized parts as matrix products."""
    names = [n for n, _ in policy.named_parameters()]
    cast = PRECISIONS[cfg.precision].train
    # the values the training forward uses (model.forward): the masters, or straight-through cast weights
    used = {n: (p.detach() + (cast(p.detach()) - p.detach())) if cast is not None else p.detach()
            for n, p in policy.named_parameters()}  # fmt: skip
    vocab, width = used[HEAD + "weight"].shape
    support = token_support(batch, rows, cols, masks.DIVERGENCES[cfg.divergence].support, vocab)
    inputs = batch.tokens[:, :-1][rows]  # [n, S]
    seq = inputs.shape[1]
    length = batch.sampled_ids.shape[1]  # the preset's response length (toy-small 4, toy-llm 19)
    at = torch.nn.functional.one_hot(cols, length).float()
    trunk_names = [n for n in names if not n.startswith(("tok.", "pos.", HEAD))]
    trunk = {n: used[n] for n in trunk_names}
    embed, position, w, b = used["tok.weight"], used["pos.weight"][:seq], used[HEAD + "weight"], used[HEAD + "bias"]

    scale = getattr(policy, "logit_scale", None)

    def hidden(tp, x0, at):  # u: the final layer norm's output at the token's position [width]
        x = x0[None]
        for i, block in enumerate(policy.blocks):
            prefix = f"blocks.{i}."
            x = functional_call(block, {n[len(prefix) :]: v for n, v in tp.items() if n.startswith(prefix)}, (x,))
        out = functional_call(policy.ln_f, {"weight": tp["ln_f.weight"], "bias": tp["ln_f.bias"]}, (x[0, -length:],))
        return (out * at[:, None]).sum(0)

    def one(tokens, at, ids, valid, is_k, log_mu, unseen, k):
        u, pullback = vjp(lambda tp, x0: hidden(tp, x0, at), trunk, embed[tokens] + position)
        z = (torch.nn.functional.linear(u[None], w, b)[0]).double()
        if scale is not None:  # toy-fork's logits are the head's times a fixed multiplier
            z = z * scale
        g_d, d = grad_and_value(lambda x: divergence_of_logits(x, ids, valid, is_k, log_mu, unseen, cfg.divergence))(z)
        g_lp = torch.nn.functional.one_hot(k, vocab).double() - torch.softmax(z, -1)
        if scale is not None:  # from here on, the gradients with respect to the head's own output
            g_d, g_lp = g_d * scale, g_lp * scale
        g_trunk, g_x0 = vmap(pullback)((torch.stack([g_d, g_lp]) @ w.double()).float())
        return d, u, g_d, g_lp, g_trunk, g_x0

    offsets, at_param = {}, 0
    for n, p in policy.named_parameters():
        offsets[n] = slice(at_param, at_param + p.numel())
        at_param += p.numel()

    def split(matrix: torch.Tensor):
        cols_ = matrix.shape[1]
        return (
            torch.cat([matrix[offsets[n]] for n in trunk_names]),  # [P_trunk, c]
            matrix[offsets["tok.weight"]].view(vocab, width, cols_),
            matrix[offsets["pos.weight"]].view(-1, width, cols_)[:seq],
            matrix[offsets[HEAD + "weight"]].reshape(vocab, width * cols_),
            matrix[offsets[HEAD + "bias"]],
        )

    v_trunk, v_tok, v_pos, v_w, v_b = split(vectors)
    k_trunk, k_tok, k_pos, k_w, k_b = split(gains)
    found: dict[str, list[torch.Tensor]] = {f.name: [] for f in dataclasses.fields(TokenProducts)}
    batched = vmap(one)
    for start in range(0, len(inputs), chunk):
        sl = slice(start, start + chunk)
        tokens = inputs[sl]
        args = (tokens, at[sl], support.ids[sl], support.valid[sl], support.is_k[sl], support.log_mu[sl],
                support.unseen[sl], support.k[sl])  # fmt: skip
        with _math_attention():
            d, u, g_d, g_lp, g_trunk, g_x0 = batched(*args)
        m = len(tokens)
        u = u.double()
        gt = torch.cat([g_trunk[n].reshape(m, 2, -1) for n in trunk_names], dim=-1).double()  # [m, 2, P_trunk]
        gx = g_x0.double()  # [m, 2, S, width]
        found["divergence"].append(d)
        # ∇D · v: blocks and norm, the embedded input (position and token rows), the head (rank one)
        dot = gt[:, 0] @ v_trunk
        dot += torch.einsum("msd,msda->ma", gx[:, 0], v_pos[None] + v_tok[tokens])
        dot += torch.einsum("mda,md->ma", (g_d @ v_w).view(m, width, -1), u) + g_d @ v_b
        found["dot"].append(dot)
        # Σ_θ ∇D ⊙ gain ⊙ ∇log π_k: a token row gathers the gradients of every position that holds it
        same = (tokens[:, :, None] == tokens[:, None, :]).double()  # [m, S, S]
        rows_d, rows_lp = same @ gx[:, 0], same @ gx[:, 1]
        tok_q = rows_d * rows_lp / same.sum(-1, keepdim=True)  # each row's product, split over its positions
        pos_q = gx[:, 0] * gx[:, 1]
        q = g_d * g_lp  # [m, V]
        u2 = u * u
        head_own = torch.einsum("mdb,md->mb", (q @ k_w).view(m, width, -1), u2) + q @ k_b
        found["own"].append(
            (gt[:, 0] * gt[:, 1]) @ k_trunk
            + torch.einsum("msd,sdb->mb", pos_q, k_pos)
            + torch.einsum("msd,msdb->mb", tok_q, k_tok[tokens])
            + head_own
        )
        found["own_head"].append(head_own)
        head_plain = q.sum(-1) * (u2.sum(-1) + 1)
        found["plain"].append((gt[:, 0] * gt[:, 1]).sum(-1) + pos_q.sum((1, 2)) + tok_q.sum((1, 2)) + head_plain)
        found["plain_head"].append(head_plain)
    if not len(inputs):
        widths = {"dot": vectors.shape[1], "own": gains.shape[1], "own_head": gains.shape[1]}
        return TokenProducts(
            **{k: torch.zeros(0, *((widths[k],) if k in widths else ()), dtype=torch.float64) for k in found}
        )
    return TokenProducts(**{k: torch.cat(v) for k, v in found.items()})


def token_products_reference(
    policy: torch.nn.Module,
    cfg: ToyConfig,
    batch: Rollout,
    rows: torch.Tensor,
    cols: torch.Tensor,
    vectors: torch.Tensor,
    gains: torch.Tensor,
    chunk: int = 48,
) -> TokenProducts:
    """`token_products` the direct way, kept as its reference (tests, bench/analysis.py): the whole
    jacobian of (D_j, log π_{k_j}) over every parameter per token, `chunk` tokens at a time (vmap of
    jacrev), then the products: 6× the CPU on toy-small, 1.4× on toy-llm (the module's docstring)."""
    names = [n for n, _ in policy.named_parameters()]
    params = {n: p.detach() for n, p in policy.named_parameters()}
    cast = PRECISIONS[cfg.precision].train
    offsets = {n: (cast(p) - p) if cast is not None else torch.zeros_like(p) for n, p in params.items()}
    support = token_support(
        batch, rows, cols, masks.DIVERGENCES[cfg.divergence].support, policy.head.out_features
    )
    inputs = batch.tokens[:, :-1][rows]
    length = batch.sampled_ids.shape[1]  # the preset's response length (toy-small 4, toy-llm 19)
    at = torch.nn.functional.one_hot(cols, length).float()

    def outputs(p, tokens, at, ids, valid, is_k, log_mu, unseen, k):
        used = {n: p[n] + offsets[n] for n in names}  # straight-through to the masters, as forward()
        logits = functional_call(policy, used, (tokens[None], length))[0]
        z = (logits * at[:, None]).sum(0)
        d = divergence_of_logits(z, ids, valid, is_k, log_mu, unseen, cfg.divergence)
        return torch.stack([d, torch.log_softmax(z.double(), -1).gather(0, k[None])[0]])

    jac = vmap(jacrev(outputs), in_dims=(None, 0, 0, 0, 0, 0, 0, 0, 0))
    values = vmap(outputs, in_dims=(None, 0, 0, 0, 0, 0, 0, 0, 0))
    sizes = [params[n].numel() for n in names]
    head = torch.cat([torch.full((s,), n.startswith(HEAD)) for n, s in zip(names, sizes, strict=True)])
    found: dict[str, list[torch.Tensor]] = {f.name: [] for f in dataclasses.fields(TokenProducts)}
    for start in range(0, len(inputs), chunk):
        sl = slice(start, start + chunk)
        args = (inputs[sl], at[sl], support.ids[sl], support.valid[sl], support.is_k[sl], support.log_mu[sl],
                support.unseen[sl], support.k[sl])  # fmt: skip
        with _math_attention():
            with torch.no_grad():
                found["divergence"].append(values(params, *args)[:, 0])
            j = jac(params, *args)
        full = torch.cat([j[n].reshape(j[n].shape[0], 2, -1) for n in names], dim=-1).double()
        del j
        g_d, g_lp = full[:, 0], full[:, 1]
        found["dot"].append(g_d @ vectors)
        q = g_d * g_lp
        found["own"].append(q @ gains)
        found["own_head"].append(q[:, head] @ gains[head])
        found["plain"].append(q.sum(-1))
        found["plain_head"].append(q[:, head].sum(-1))
    if not len(inputs):
        widths = {"dot": vectors.shape[1], "own": gains.shape[1], "own_head": gains.shape[1]}
        return TokenProducts(
            **{k: torch.zeros(0, *((widths[k],) if k in widths else ()), dtype=torch.float64) for k in found}
        )
    return TokenProducts(**{k: torch.cat(v) for k, v in found.items()})


@contextlib.contextmanager
def _math_attention():
    """scaled_dot_product_attention written out while the per-token jacobians run: torch.func has no
    batching rule for the CPU flash kernel and falls back to a loop over the tokens, 20× slower. The same
    function (causal softmax(q kᵀ / √d) v), to float32 rounding; the model's own forward is untouched."""

    def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or enable_gqa:
            raise NotImplementedError("the per-token jacobians take causal attention only")
        scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
        if is_causal:
            t, s = scores.shape[-2:]
            scores = scores.masked_fill(~torch.ones(t, s, dtype=torch.bool).tril(), -torch.inf)
        return torch.softmax(scores, dim=-1) @ v

    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
