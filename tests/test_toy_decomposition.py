"""ΔD decomposed per out-of-region token: the pieces sum, the own effect is what it says, the
own-effect protocols run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdmctl import masks
from pdmctl.analysis import decomposition
from pdmctl.analysis.decomposition_rows import _assumption_rows, _decomposition_rows
from pdmctl.analysis.protocols import snapshot, take_update
from pdmctl.analysis.results import ESTIMATORS
from pdmctl.analysis.run import _analyse_seed
from pdmctl.backends.toy import ToyConfig, task
from pdmctl.backends.toy.model import forward
from pdmctl.backends.toy.probe import diagnostics, stale_batch
from tests.conftest import pdmctl

CFG = ToyConfig(prompts_per_step=16)


@pytest.fixture(scope="module")
def stale():
    learner, batch, advantages = stale_batch(CFG)
    return learner, batch, advantages, snapshot(learner)


def _out_of_region_tokens(learner, batch, advantages):
    d = diagnostics(learner, batch, advantages, CFG, "exact")
    response = task.response_mask(batch.sampled_ids).bool()
    a = advantages.unsqueeze(1).expand_as(response)
    rows, cols = (d.out_of_region & response & (a != 0)).nonzero(as_tuple=True)
    return d, rows, cols


@pytest.mark.parametrize("protocol", ["carried", "fresh-adam", "sgd"])
def test_the_step_is_momentum_plus_gain_times_gradient_and_the_pieces_sum(stale, protocol) -> None:
    """Δθ = m + K ⊙ g reconstructs torch's own step, so own + others + momentum is the first-order ΔD along
    the realized step (float64 products; what is left is the float32 rounding of the weights)."""
    learner, batch, advantages, start = stale
    params = list(learner.policy.parameters())
    theta0 = decomposition.flat(params)
    criterion = dataclasses.replace(CFG, method="dppo")
    metrics = take_update(learner, start, batch, advantages, criterion, protocol)
    parts = decomposition.update_parts(
        params, theta0, start.optimizer, criterion, protocol, metrics["grad_norm"]
    )
    rebuilt = parts.momentum + parts.gain * parts.grad
    step_norm = float(torch.linalg.vector_norm(parts.step))
    assert step_norm > 0
    assert float(torch.linalg.vector_norm(rebuilt - parts.step)) < 1e-4 * step_norm
    assert (protocol == "carried") == bool((parts.momentum != 0).any())
    learner.policy.load_state_dict(start.weights)
    _, rows, cols = _out_of_region_tokens(learner, batch, advantages)
    assert len(rows) > 20
    vectors = torch.stack([parts.step, parts.momentum, parts.gain * parts.grad], dim=1)
    gains = parts.gain.expand(len(theta0)).unsqueeze(1)
    products = decomposition.token_products(learner.policy, CFG, batch, rows, cols, vectors, gains)
    first, momentum, gradient = products.dot.unbind(1)
    with torch.no_grad():
        logits = forward(learner.policy, batch.tokens[:, :-1], task.MAX_RESPONSE_LEN, None)
    alpha = decomposition.loss_coefficients(logits, batch, advantages, criterion)[rows, cols]
    own = parts.clip * alpha * products.own[:, 0]
    others = gradient - own
    scale = own.abs() + others.abs() + momentum.abs()
    assert bool((scale > 0).all())
    assert float(((own + others + momentum - first).abs() / scale).max()) < 1e-3
    assert bool((own != 0).any()) and bool((others != 0).all())


def test_per_token_gradients_match_plain_autograd(stale) -> None:
    """The vmapped jacobians give, for a few tokens, what one backward pass per token gives; α is ∂L/∂log π_k
    of the criterion's loss (Σ α log π_k has the loss's gradient)."""
    learner, batch, advantages, start = stale
    learner.policy.load_state_dict(start.weights)
    params = list(learner.policy.parameters())
    d, rows, cols = _out_of_region_tokens(learner, batch, advantages)
    rows, cols = rows[:3], cols[:3]
    n = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(0)
    vectors = torch.randn(n, 2, generator=gen, dtype=torch.float64)
    gains = torch.rand(n, 1, generator=gen, dtype=torch.float64)
    products = decomposition.token_products(learner.policy, CFG, batch, rows, cols, vectors, gains)
    support = decomposition.token_support(batch, rows, cols, "topk", learner.policy.head.out_features)
    for i, (r, c) in enumerate(zip(rows.tolist(), cols.tolist(), strict=True)):
        logits = learner.policy(batch.tokens[r : r + 1, :-1], task.MAX_RESPONSE_LEN)[0, c]
        s = [getattr(support, f)[i] for f in ("ids", "valid", "is_k", "log_mu", "unseen")]
        d_j = decomposition.divergence_of_logits(logits, *s, CFG.divergence)
        assert float(d_j) == pytest.approx(float(d.divergence[r, c]), abs=1e-5)  # the mask's D
        g_d = decomposition.flat(torch.autograd.grad(d_j, params, retain_graph=True))
        g_lp = decomposition.flat(
            torch.autograd.grad(torch.log_softmax(logits, -1)[batch.sampled_ids[r, c]], params)
        )
        torch.testing.assert_close(products.dot[i], g_d @ vectors, rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(
            products.own[i, 0], (g_d * gains[:, 0] * g_lp).sum(), rtol=1e-4, atol=1e-12
        )
        torch.testing.assert_close(products.plain[i], g_d @ g_lp, rtol=1e-4, atol=1e-12)
    criterion = dataclasses.replace(CFG, method="pdm", estimator="uni")
    logits = forward(learner.policy, batch.tokens[:, :-1], task.MAX_RESPONSE_LEN, None)
    alpha = decomposition.loss_coefficients(logits.detach(), batch, advantages, criterion)
    log_pi_k = torch.log_softmax(logits, -1).gather(-1, batch.sampled_ids.unsqueeze(-1)).squeeze(-1)
    surrogate = torch.autograd.grad((alpha * log_pi_k.double()).sum(), params, retain_graph=True)
    resp = task.response_mask(batch.sampled_ids)
    loss, _ = masks.policy_loss(
        logits, batch.sampled_ids, batch.topk_ids, batch.topk_logprobs, batch.sampled_logprobs,
        advantages.unsqueeze(1).expand_as(resp), resp, method="pdm", divergence=CFG.divergence, estimator="uni",
        delta=CFG.delta, eps_low=CFG.eps_low, eps_high=CFG.eps_high, loss_agg_mode=CFG.loss_agg_mode,
        ratio_cap=CFG.ratio_cap,
    )  # fmt: skip
    true = decomposition.flat(torch.autograd.grad(loss, params))
    assert float(torch.linalg.vector_norm(decomposition.flat(surrogate) - true)) < 1e-5 * float(
        torch.linalg.vector_norm(true)
    )


def test_own_effect_in_logit_space_is_the_analytic_e_k_minus_pi_direction(stale) -> None:
    """The own effect's logit-space piece is dD/dη along e_k − π: the mask's analytic Ḋ_exact. Through the last
    layer alone (logits z = W x + b) the own effect is that derivative times |x|² + 1, whatever the token."""
    learner, batch, advantages, start = stale
    learner.policy.load_state_dict(start.weights)
    d, rows, cols = _out_of_region_tokens(learner, batch, advantages)
    with torch.no_grad():
        hidden = {}
        hook = learner.policy.ln_f.register_forward_hook(lambda m, i, o: hidden.setdefault("x", o))
        logits = learner.policy(batch.tokens[:, :-1], task.MAX_RESPONSE_LEN)
        hook.remove()
    support = decomposition.token_support(batch, rows, cols, "topk", logits.shape[-1])
    ddot = decomposition.logit_ddot(logits[rows, cols], support, CFG.divergence)
    exact = d.ddot[rows, cols].double()
    assert float((ddot - exact).abs().max()) < 1e-6 + 1e-4 * float(exact.abs().max())
    assert bool((torch.sign(ddot) == torch.sign(exact)).all())
    n = sum(p.numel() for p in learner.policy.parameters())
    one = torch.ones(n, 1, dtype=torch.float64)
    products = decomposition.token_products(learner.policy, CFG, batch, rows, cols, one, one)
    x = hidden["x"][rows, cols].double()
    expected = ddot * (x.pow(2).sum(-1) + 1)
    # x and ddot are float32 values: their rounding (which the thread count and the vector unit change) reaches
    # ~5e-6 of the largest value; a wrong formula misses by the values themselves
    torch.testing.assert_close(products.plain_head, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
    assert float((products.plain - products.plain_head).abs().median()) > 0  # the rest of the network moves D


def test_own_effect_protocols_run_differ_from_carried_and_are_the_decompositions_own_piece() -> None:
    protocols = ("carried", "own-adam", "own-grad")
    _, _, found, parts = _analyse_seed(dataclasses.replace(CFG, seed=7), protocols)
    assert set(parts.by_update) == {
        ("carried", c) for c in ("ratio", *(f"predictive/{e}" for e in ESTIMATORS))
    }
    pooled = {p: [] for p in protocols}
    for e in ESTIMATORS:
        carried = found["carried"][e].predictive_kept_delta_d.double()
        own_adam = found["own-adam"][e].predictive_kept_delta_d
        assert carried.numel() == own_adam.numel() == found["own-grad"][e].predictive_kept_delta_d.numel()
        # own-adam's ΔD is the own piece of the carried update's decomposition, token for token
        assert bool(torch.isin(own_adam, parts.by_update["carried", f"predictive/{e}"]["own"]).all())
        for p in protocols:
            pooled[p] += [
                found[p][e].predictive_kept_delta_d.double(),
                found[p][e].ratio_kept_delta_d.double(),
            ]
    carried, own_adam, own_grad = (torch.cat(pooled[p]) for p in protocols)
    assert carried.numel() > 0
    assert not torch.allclose(carried, own_adam) and not torch.allclose(own_adam, own_grad)
    for pieces in parts.by_update.values():  # the own effect's sign is not the realized ΔD's everywhere
        assert pieces["own"].numel() > 5
        assert 0 < float((torch.sign(pieces["own"]) == torch.sign(pieces["realized"])).double().mean()) < 1
    rows = _decomposition_rows([parts])
    assert [r.protocol for r in rows] == ["carried"] * 4
    for r in rows:
        assert r.tokens > 5 and r.momentum_share is not None and r.momentum_sign is not None
        assert 0 < r.own_share < 1 and 0 < r.momentum_share < 1 and len(r.own_share_per_seed) == 1
    assumption = {r.own_effect.split(",")[0]: r for r in _assumption_rows([parts])}
    # sign(own, logit space) = sign(A·Ḋ_exact) by definition, and so is the last layer's (times |x|² + 1)
    assert assumption["logit space"].agrees_exact == 1.0
    assert assumption["last layer only"].agrees_exact == 1.0
    assert assumption["whole network"].tokens == assumption["logit space"].tokens > 5
    assert 0 < assumption["whole network"].last_layer_share < 1
    # the per-token D (attention written out, float32 logits) is the mask's, to float32 rounding of the forward
    assert float(parts.assumption["divergence_check"].abs().max()) < 1e-5


def test_a_bad_protocol_is_one_line_and_exit_2(tmp_path) -> None:
    # one subprocess (its import of torch is most of the test's time); repeats and "," are in test_cli_misc
    res = pdmctl("analyze", "--protocols", "own-adam,bogus", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--protocols" in res.stderr
    assert "own-adam" in res.stderr and "own-grad" in res.stderr  # the new names are offered


@pytest.mark.parametrize("model", ["toy-small", "toy-llm", "toy-fork"])
def test_structured_products_are_the_whole_jacobians(model) -> None:
    """token_products (head rank one, embedding through its input, per-token gradients of the blocks only) gives
    what the whole per-token jacobians give, on tokens whose sequences repeat a token (an embedding row that
    gathers several positions' gradients), at toy-llm's 19-token responses too."""
    cfg = dataclasses.replace(CFG, model=model, precision="fp8_e2e")  # the straight-through cast weights too
    learner, batch, _ = stale_batch(dataclasses.replace(cfg, prompts_per_step=4))
    response = task.response_mask(batch.sampled_ids).bool()
    inputs = batch.tokens[:, :-1]
    repeats = torch.tensor([len(set(row.tolist())) < len(row) for row in inputs])
    rows, cols = (response & repeats[:, None]).nonzero(as_tuple=True)
    pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[:6]
    rows, cols = rows[pick], cols[pick]
    assert len(rows) == 6 and int(cols.max()) >= (1 if model == "toy-small" else 10)
    n = sum(p.numel() for p in learner.policy.parameters())
    gen = torch.Generator().manual_seed(1)
    vectors, gains = torch.randn(n, 3, generator=gen, dtype=torch.float64), torch.rand(n, 2, generator=gen).double()
    fast = decomposition.token_products(learner.policy, cfg, batch, rows, cols, vectors, gains)
    slow = decomposition.token_products_reference(learner.policy, cfg, batch, rows, cols, vectors, gains)
    for name in ("dot", "own", "own_head", "plain", "plain_head", "divergence"):
        a, b = getattr(fast, name), getattr(slow, name)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()), msg=name)
