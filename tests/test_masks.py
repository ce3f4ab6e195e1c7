"""pdmctl.masks against MATH.md: autograd, a plain per-token loop, the worked example."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdmctl.masks import (
    AGGREGATIONS,
    DIVERGENCES,
    ESTIMATORS,
    METHODS,
    compute_mask,
    policy_loss,
    token_diagnostics,
    update_metrics,
)

# ---------------------------------------------------------------------------
# helpers: a rollout distribution μ near π, its top-K, a sampled token
# ---------------------------------------------------------------------------


def make_batch(n=8, vocab=40, k=5, *, seed=0, dtype=torch.float64, spread=2.0, drift=0.5, k_outside=None):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * spread
    log_mu = torch.log_softmax(z + drift * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    top = log_mu.topk(min(k, vocab), dim=-1)
    sampled = torch.multinomial(log_mu.exp(), 1, generator=g).squeeze(-1)
    if k_outside is not None:  # force the sampled token outside (False: inside) the top-K
        order = log_mu.argsort(-1, descending=True)
        sampled = order[:, -1] if k_outside else order[:, 0]
    sampled_lp = log_mu.gather(-1, sampled[:, None]).squeeze(-1)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return z.to(dtype), sampled, top.indices, top.values, sampled_lp, adv


def reference_divergence(z, mu_full_lp, support_ids, family):
    """D(z) written straight from MATH.md on the full logits (for autograd)."""
    pi = torch.softmax(z, -1)
    mu = mu_full_lp.exp()
    pi_s, mu_s = pi[support_ids], mu[support_ids]
    pi_tail, mu_tail = (1 - pi_s.sum()).clamp_min(1e-12), (1 - mu_s.sum()).clamp_min(1e-12)
    if family == "kl":
        return (mu_s * (mu_s / pi_s).log()).sum() + mu_tail * (mu_tail / pi_tail).log()
    return 0.5 * ((mu_s - pi_s).abs().sum() + (mu_tail - pi_tail).abs())


# ---------------------------------------------------------------------------
# Ḋ equals the directional derivative of D along v = e_k − π (torch.func.jvp)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("divergence", ["topk_kl", "topk_tv", "binary_kl", "binary_tv"])
@pytest.mark.parametrize("k_outside", [False, True])
def test_ddot_exact_equals_jvp(divergence, k_outside):
    n, vocab, k = 6, 30, 4
    g = torch.Generator().manual_seed(7)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 1.5
    log_mu = torch.log_softmax(z + 0.7 * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    top = log_mu.topk(k, dim=-1)
    order = log_mu.argsort(-1, descending=True)
    sampled = order[:, -3] if k_outside else order[:, 1]
    sampled_lp = log_mu.gather(-1, sampled[:, None]).squeeze(-1)
    d = token_diagnostics(
        z, sampled, top.indices, top.values, sampled_lp, torch.ones(n, dtype=torch.float64),
        divergence=divergence, estimator="exact", delta=0.1,
    )  # fmt: skip
    spec = DIVERGENCES[divergence]
    for t in range(n):
        kt = int(sampled[t])
        if spec.support == "binary":
            support_ids = torch.tensor([kt])
        else:
            ids = top.indices[t].tolist()
            support_ids = torch.tensor(ids if kt in ids else [*ids, kt])
        v = torch.nn.functional.one_hot(torch.tensor(kt), vocab).double() - torch.softmax(z[t], -1)
        d_ref, ddot_ref = torch.func.jvp(
            lambda zz, t=t, s=support_ids: reference_divergence(zz, log_mu[t], s, spec.family.name),
            (z[t],),
            (v,),
        )
        # float32 outputs: compare the float64 recomputation below for the 1e-8 bound
        assert math.isclose(float(d.divergence[t]), float(d_ref), rel_tol=1e-6, abs_tol=1e-9)
        assert (kt in top.indices[t].tolist()) != k_outside or spec.support == "binary"
        ddot64 = _ddot64(z, sampled, top, sampled_lp, divergence, "exact")[t]
        assert abs(ddot64 - float(ddot_ref)) <= 1e-8 * max(abs(float(ddot_ref)), 1e-12)


def _ddot64(z, sampled, top, sampled_lp, divergence, estimator):
    """Ḋ in float64 straight from the module internals (the public result is float32)."""
    from pdmctl import masks

    spec = DIVERGENCES[divergence]
    est = ESTIMATORS[estimator]
    s, tail_sum_sq = masks.token_support(z, sampled, top.indices, top.values, sampled_lp, spec.support,
                                         need_tail_sum_sq=est.needs_tail_sum_sq)  # fmt: skip
    return spec.family.ddot(s, est.q_tail(s, tail_sum_sq)).tolist()


def test_kl_simplification_equals_general_formula():
    from pdmctl import masks
    from pdmctl.masks import loss

    z, sampled, ids, lps, slp, _ = make_batch(n=32, vocab=50, k=6, seed=3)
    s, q_tail = masks.token_support(z, sampled, ids, lps, slp, "topk", need_tail_sum_sq=True)
    general = masks.ddot_from_gradient(s, -s.mu / s.pi, -s.mu_tail / s.pi_tail, q_tail)
    torch.testing.assert_close(loss._ddot_kl(s, q_tail), general, rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------------------
# Corner cases
# ---------------------------------------------------------------------------


def _jvp_ddot(z_row, log_mu_row, support_ids, k, family):
    """D and its derivative along v = e_k − π by autograd, D as MATH.md writes it (μ_tail clamped to ε)."""
    v = torch.nn.functional.one_hot(torch.tensor(k), z_row.shape[-1]).double() - torch.softmax(z_row, -1)
    d, ddot = torch.func.jvp(
        lambda zz: reference_divergence(zz, log_mu_row, support_ids, family), (z_row,), (v,)
    )
    return float(d), float(ddot)


def test_kl_ddot_when_the_rollout_top_k_sums_above_one():
    """bf16-rounded top-K log-probabilities can sum above 1; μ_tail is then clamped to ε and
    Ḋ must still be the derivative of that D (it was −1.0e-05 here, the derivative +3.8e-05: kept, not masked)."""
    pi = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    mu_s = torch.tensor([[0.5251625, 0.4752375]], dtype=torch.float64)  # Σ_S μ = 1.0004
    args = (pi.log(), torch.tensor([0]), torch.tensor([[0, 1]]), mu_s.log(), mu_s.log()[:, 0],
            torch.tensor([1.0], dtype=torch.float64))  # fmt: skip
    log_mu_full = torch.cat([mu_s.log()[0], torch.tensor([-math.inf], dtype=torch.float64)])
    d_ref, ddot_ref = _jvp_ddot(pi.log()[0], log_mu_full, torch.tensor([0, 1]), 0, "kl")
    assert ddot_ref == pytest.approx(3.8e-5, rel=1e-3)
    for estimator in ESTIMATORS:  # the tail {2} is one token: every estimator is exact here
        d = token_diagnostics(*args, estimator=estimator, delta=0.15)
        assert float(d.divergence[0]) == pytest.approx(d_ref, rel=1e-6)
        assert float(d.divergence[0]) == pytest.approx(0.2444, abs=1e-4)
        top = torch.return_types.topk((args[3], args[2]))
        assert _ddot64(args[0], args[1], top, args[4], "topk_kl", estimator)[0] == pytest.approx(
            ddot_ref, rel=1e-8
        )
        assert not bool(compute_mask(*args, method="pdm", estimator=estimator, delta=0.15).keep[0])


@pytest.mark.parametrize("divergence", ["topk_kl", "topk_tv"])
@pytest.mark.parametrize("k_outside", [False, True])
def test_ddot_is_the_jvp_whatever_the_rollout_sum(divergence, k_outside):
    """μ on S scaled so that Σ_S μ_i = 1 + 1e-4 … 1e-2 (μ_tail clamped): Ḋ is still the jvp of D."""
    n, vocab, k = 8, 30, 4
    g = torch.Generator().manual_seed(19)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 1.5
    log_mu = torch.log_softmax(z + 0.7 * torch.randn(n, vocab, generator=g, dtype=torch.float64), -1)
    order = log_mu.argsort(-1, descending=True)
    sampled = order[:, -3] if k_outside else order[:, 1]
    top_ids = order[:, :k]
    support = torch.zeros(n, vocab, dtype=torch.bool)
    support[torch.arange(n)[:, None], top_ids] = True
    support[torch.arange(n), sampled] = True
    excess = 10 ** torch.empty(n, dtype=torch.float64).uniform_(-4, -2, generator=g)
    scale = (1 + excess) / (log_mu.exp() * support).sum(-1)  # Σ_S μ = 1 + excess
    log_mu = torch.where(support, log_mu + scale.log()[:, None], -math.inf)
    top = torch.return_types.topk((log_mu.gather(-1, top_ids), top_ids))
    sampled_lp = log_mu.gather(-1, sampled[:, None]).squeeze(-1)
    ddot64 = _ddot64(z, sampled, top, sampled_lp, divergence, "exact")
    for t in range(n):
        ids = support[t].nonzero().squeeze(-1)
        _, ddot_ref = _jvp_ddot(z[t], log_mu[t], ids, int(sampled[t]), DIVERGENCES[divergence].family.name)
        assert abs(ddot64[t] - ddot_ref) <= 1e-8 * max(abs(ddot_ref), 1e-12), (t, ddot64[t], ddot_ref)


def _tiny_pi_k_batch(tail_logit: float, mu_top: float):
    """V = 1,000: z = 40 at id 0, `tail_logit` elsewhere, 2 at the sampled id 1 (π_k ≈ 3e-17); μ_k = 0.5, A = −1."""
    z = torch.full((1, 1000), tail_logit, dtype=torch.float64)
    z[0, 0], z[0, 1] = 40.0, 2.0
    lp = lambda x: torch.tensor([x], dtype=torch.float64).log()  # noqa: E731
    return z, torch.tensor([1]), torch.tensor([[0]]), lp(mu_top)[None], lp(0.5), torch.tensor([-1.0]).double()


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_binary_tv_ddot_keeps_its_sign_at_tiny_pi_k(estimator):
    """With π_k ≈ 3e-17 binary TV's Ḋ once cancelled to 0 (agg, exact: kept where DPPO masks).
    On a binary support Ḋ = (g_k − g_tail) π_k ((1 − π_k)² + Q_tail), here −π_k (1 + Q_tail)."""
    args = _tiny_pi_k_batch(2.0, 0.4)
    d = token_diagnostics(*args, divergence="binary_tv", estimator=estimator)
    pi = torch.softmax(args[0][0], -1)
    pi_k, pi_tail = float(pi[1]), float(1 - pi[1])
    q_tail = {"agg": pi_tail**2, "uni": pi_tail**2 / 999, "exact": float((pi**2).sum() - pi[1] ** 2)}[
        estimator
    ]
    assert float(d.ddot[0]) == pytest.approx(-pi_k * (pi_tail**2 + q_tail), rel=1e-6, abs=0)
    for method in ("pdm", "dppo"):  # A < 0, r < 1, D = 0.5 > δ: both mask
        assert not bool(
            compute_mask(*args, method=method, divergence="binary_tv", estimator=estimator).keep[0]
        )


def test_topk_tv_ddot_at_tiny_pi_k():
    """The same on a top-K support where only k's slot moves D: S = {0, k}, π_0 > μ_0, π_tail > μ_tail, so
    g_0 = g_tail and Ḋ = −π_k ((1 − π_k)² + π_0² + Q_tail) ≈ −5.0e-17 (it came out −5.6e-17)."""
    args = _tiny_pi_k_batch(31.0, 0.45)
    pi = torch.softmax(args[0][0], -1)
    q_tail = float((pi[2:] ** 2).sum())
    expected = -float(pi[1]) * (float(1 - pi[1]) ** 2 + float(pi[0]) ** 2 + q_tail)
    top = torch.return_types.topk((args[3], args[2]))
    assert _ddot64(args[0], args[1], top, args[4], "topk_tv", "exact")[0] == pytest.approx(
        expected, rel=1e-9, abs=0
    )


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 12), spread=st.floats(0.1, 6.0))
def test_kl_exact_lies_between_agg_and_uni(seed, k, spread):
    batch = make_batch(n=16, vocab=24, k=k, seed=seed, spread=spread)
    z, sampled, ids, lps, slp, _ = batch
    top = torch.return_types.topk((lps, ids))
    agg, uni, exact = (_ddot64(z, sampled, top, slp, "topk_kl", e) for e in ("agg", "uni", "exact"))
    for a, u, x in zip(agg, uni, exact, strict=True):
        assert min(a, u) - 1e-12 <= x <= max(a, u) + 1e-12


def test_binary_kl_agg_closed_form():
    z, sampled, ids, lps, slp, adv = make_batch(n=64, vocab=30, k=5, seed=11)
    d = token_diagnostics(z, sampled, ids, lps, slp, adv, divergence="binary_kl", estimator="agg")
    pi_k = torch.softmax(z, -1).gather(-1, sampled[:, None]).squeeze(-1)
    mu_k = slp.exp()
    torch.testing.assert_close(d.ddot.double(), 2 * (1 - pi_k) * (pi_k - mu_k), rtol=1e-5, atol=1e-7)
    # with binary divergences the predictive direction is the ratio direction
    assert torch.equal(torch.sign(d.ddot), torch.sign(d.ratio - 1))


def test_worked_example_corrected():
    # S = {k, 2}: π_k = 0.4, μ_k = 0.35, π_2 = 0.3, μ_2 = 0.25, π_tail = 0.3, μ_tail = 0.4, n − m = 3
    pi = torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.1]], dtype=torch.float64)
    mu = torch.tensor([[0.35, 0.25, 0.4 / 3, 0.4 / 3, 0.4 / 3]], dtype=torch.float64)
    ids = torch.tensor([[0, 1]])
    args = (
        pi.log(),
        torch.tensor([0]),
        ids,
        mu.log()[:, :2],
        mu.log()[:, 0],
        torch.tensor([1.0], dtype=torch.float64),
    )
    agg = token_diagnostics(*args, estimator="agg", delta=1e-3)
    uni = token_diagnostics(*args, estimator="uni", delta=1e-3)
    assert float(agg.ddot[0]) == pytest.approx(0.045, abs=1e-7)
    assert float(uni.ddot[0]) == pytest.approx(0.025, abs=1e-7)
    res = compute_mask(*args, method="pdm", estimator="agg", delta=1e-3)
    assert not bool(res.keep[0])  # A > 0, D > δ, Ḋ > 0: masked


@pytest.mark.parametrize("divergence", sorted(DIVERGENCES))
def test_zero_advantage_convention(divergence):
    """MATH.md, "At A = 0": A = 0 is on the A ≥ 0 side (δ_high), no method masks it, it never disagrees.
    (DPPO's code and VeRL's dppo_kl/dppo_tv send A = 0 down the A < 0 branch, δ_low and `r < 1` masks.)"""
    z, sampled, ids, lps, slp, _ = make_batch(n=256, vocab=60, k=8, seed=5, drift=1.5)
    kw = dict(divergence=divergence, estimator="exact", delta=0.05, delta_low=0.5)
    sides = {a: token_diagnostics(z, sampled, ids, lps, slp, torch.full((256,), a, dtype=torch.float64), **kw)
             for a in (0.0, 1.0, -1.0)}  # fmt: skip
    zero = sides[0.0]
    assert torch.equal(zero.out_of_region, sides[1.0].out_of_region)  # δ_high = 0.05
    assert not torch.equal(zero.out_of_region, sides[-1.0].out_of_region)  # δ_low = 0.5 would differ
    assert zero.out_of_region.any() and not zero.disagree.any()
    for method in METHODS:
        adv = torch.zeros(256, dtype=torch.float64)
        assert compute_mask(z, sampled, ids, lps, slp, adv, method=method, **kw).keep.all()
        logits = z.clone().requires_grad_(True)
        loss, metrics = policy_loss(logits, sampled, ids, lps, slp, adv, torch.ones(256), method=method, **kw)
        loss.backward()
        assert metrics["mask_frac"] == 0.0 and metrics["disagreement_count"] == 0.0
        assert not logits.grad.any()  # whichever convention: the token's loss is 0 · log π_k


# ---------------------------------------------------------------------------
# The masks equal a plain per-token loop written from MATH.md
# ---------------------------------------------------------------------------


def loop_reference(z, sampled, ids, lps, slp, adv, *, method, divergence, estimator, delta, delta_low, eps):
    """One token at a time, python floats, the formulas of MATH.md as written (general Ḋ)."""
    out = []
    for t in range(z.shape[0]):
        row = z[t].tolist()
        mx = max(row)
        ex = [math.exp(x - mx) for x in row]
        tot = sum(ex)
        pi = [e / tot for e in ex]
        n = len(pi)
        kt = int(sampled[t])
        mu_k_sampled = math.exp(float(slp[t]))
        if DIVERGENCES[divergence].support == "binary":
            support = {kt: mu_k_sampled}
        else:
            support = {
                int(i): math.exp(float(lp)) for i, lp in zip(ids[t], lps[t], strict=True) if lp > -math.inf
            }
            support.setdefault(kt, mu_k_sampled)
        pi_tail = max(1 - sum(pi[i] for i in support), 1e-12)
        mu_tail = max(1 - sum(support.values()), 1e-12)
        family = DIVERGENCES[divergence].family.name
        if family == "kl":
            d = sum(m * math.log(m / pi[i]) for i, m in support.items() if m > 0)
            d += mu_tail * math.log(mu_tail / pi_tail)
            g = {i: -m / pi[i] for i, m in support.items()}
            g_tail = -mu_tail / pi_tail
        else:
            d = 0.5 * (sum(abs(m - pi[i]) for i, m in support.items()) + abs(mu_tail - pi_tail))
            sgn = lambda x: (x > 0) - (x < 0)  # noqa: E731
            g = {i: 0.5 * sgn(pi[i] - m) for i, m in support.items()}
            g_tail = 0.5 * sgn(pi_tail - mu_tail)
        q_s = sum(pi[i] ** 2 for i in support)
        q_tail = {
            "agg": pi_tail**2,
            "uni": pi_tail**2 / max(n - len(support), 1),
            "exact": max(sum(p * p for p in pi) - q_s, 0.0),
        }[estimator]
        q = q_s + q_tail
        ddot = (
            g[kt] * pi[kt]
            - sum(g[i] * pi[i] ** 2 for i in support)
            - g_tail * q_tail
            - (pi[kt] - q) * (sum(g[i] * pi[i] for i in support) + g_tail * pi_tail)
        )
        r = pi[kt] / mu_k_sampled
        a = float(adv[t])
        dl = delta if (a >= 0 or delta_low is None) else delta_low
        if method == "grpo":  # no cap here; VeRL's clamp of log r to ±20 leaves no gradient beyond
            beyond = a != 0 and not math.exp(-20) <= r <= math.exp(20)
            masked = beyond or (a > 0 and r > 1 + eps[1]) or (a < 0 and r < 1 - eps[0])
        elif method == "dppo":
            masked = d > dl and a * (r - 1) > 0
        else:
            masked = d > dl and a * ddot > 0
        # TV's sign(π_i − μ_i) is arbitrary where the two agree to rounding: no reference value there
        tied = family == "tv" and (any(abs(pi[i] - m) < 1e-9 for i, m in support.items())
                                   or abs(pi_tail - mu_tail) < 1e-9)  # fmt: skip
        out.append((not masked, d, ddot, r, tied or abs(d - dl) < 1e-9 or abs(a * ddot) < 1e-12))
    return out


def _pad_topk(ids, lps, n_pad):
    """Append -inf padded slots (ids arbitrary) as an engine does when fewer than K came back."""
    if n_pad == 0:
        return ids, lps
    pad_ids = torch.zeros(ids.shape[0], n_pad, dtype=ids.dtype)
    pad_lps = torch.full((ids.shape[0], n_pad), -math.inf, dtype=lps.dtype)
    return torch.cat([ids, pad_ids], -1), torch.cat([lps, pad_lps], -1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 12),
    vocab=st.integers(2, 40),
    k=st.integers(1, 45),
    n_pad=st.integers(0, 3),
    seed=st.integers(0, 100_000),
    spread=st.floats(0.05, 8.0),
    drift=st.floats(0.0, 2.0),
    method=st.sampled_from(sorted(METHODS)),
    divergence=st.sampled_from(sorted(DIVERGENCES)),
    estimator=st.sampled_from(sorted(ESTIMATORS)),
    delta=st.floats(1e-4, 0.5),
    delta_low=st.one_of(st.none(), st.floats(1e-4, 0.5)),
)
def test_masks_equal_per_token_loop(
    n, vocab, k, n_pad, seed, spread, drift, method, divergence, estimator, delta, delta_low
):
    z, sampled, ids, lps, slp, adv = make_batch(n=n, vocab=vocab, k=k, seed=seed, spread=spread, drift=drift)
    ids, lps = _pad_topk(ids, lps, n_pad)
    kw = dict(method=method, divergence=divergence, estimator=estimator, delta=delta, delta_low=delta_low)
    res = compute_mask(z, sampled, ids, lps, slp, adv, **kw)
    ref = loop_reference(z, sampled, ids, lps, slp, adv, **kw, eps=(0.2, 0.28))
    for t, (keep, d, ddot, r, borderline) in enumerate(ref):
        assert float(res.ratio[t]) == pytest.approx(r, rel=1e-5)
        if METHODS[method].uses_divergence:
            assert float(res.divergence[t]) == pytest.approx(d, rel=1e-4, abs=1e-7)
        else:
            assert res.divergence is None
        if not METHODS[method].uses_ddot:
            assert res.ddot is None
        elif not borderline:
            assert float(res.ddot[t]) == pytest.approx(ddot, rel=1e-4, abs=1e-7)
        if not borderline:
            assert bool(res.keep[t]) == keep, (t, d, ddot, r)


def test_masks_reduce_to_each_other():
    z, sampled, ids, lps, slp, adv = make_batch(n=256, vocab=60, k=8, seed=5, drift=1.5)
    # binary divergences: predictive direction == ratio direction, so PDM == DPPO
    for div in ("binary_kl", "binary_tv"):
        pdm = compute_mask(z, sampled, ids, lps, slp, adv, method="pdm", divergence=div, delta=0.01)
        dppo = compute_mask(z, sampled, ids, lps, slp, adv, method="dppo", divergence=div, delta=0.01)
        assert torch.equal(pdm.keep, dppo.keep)
    # a δ above every D keeps everything for both divergence masks
    for method in ("pdm", "dppo"):
        assert compute_mask(z, sampled, ids, lps, slp, adv, method=method, delta=1e6).keep.all()
    # top-K: PDM and DPPO differ exactly on the disagreement tokens
    d = token_diagnostics(z, sampled, ids, lps, slp, adv, method="pdm", delta=0.02)
    dppo = compute_mask(z, sampled, ids, lps, slp, adv, method="dppo", delta=0.02)
    assert d.disagree.any()
    assert torch.equal(d.keep != dppo.keep, d.disagree & (adv != 0))


# ---------------------------------------------------------------------------
# Loss and gradient
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
@pytest.mark.parametrize("method", ["grpo", "dppo", "pdm"])
def test_loss_gradient_is_weighted_score(mode, method):
    """The gradient is −A·min(r, C)·M·(e_k − π) per token, normalised as the mode says: DPPO's and PDM's
    loss by definition; GRPO's PPO clip too, with M its mask at the same C (the dual clip A < 0 ∧ r > C
    and the clipped tokens have none; a kept token has r ≤ C)."""
    b, t, vocab, k, cap = 3, 7, 25, 4, 1.3
    z, sampled, ids, lps, slp, adv = make_batch(n=b * t, vocab=vocab, k=k, seed=2, drift=1.0)
    mask = (torch.rand(b, t, generator=torch.Generator().manual_seed(1)) > 0.3).double()
    mask[:, 0] = 1
    logits = z.reshape(b, t, vocab).clone().requires_grad_(True)
    loss, metrics = policy_loss(
        logits, sampled.reshape(b, t), ids.reshape(b, t, k), lps.reshape(b, t, k), slp.reshape(b, t),
        adv.reshape(b, t), mask, method=method, delta=0.02, loss_agg_mode=mode, ratio_cap=cap,
    )  # fmt: skip
    loss.backward()
    res = compute_mask(z, sampled, ids, lps, slp, adv, method=method, delta=0.02, ratio_cap=cap)
    if method == "grpo":  # the batch has dual-clipped tokens, so this checks the dual clip
        assert bool(((adv < 0) & (res.ratio > cap) & ~res.keep).any())
    # ∇ log π_k = e_k − π; the token weight is A·min(r, C)·M, then the aggregation's normaliser
    weight = (adv * res.ratio.double().clamp(max=cap) * res.keep.double()).reshape(b, t) * mask
    norm = {
        "token-mean": torch.full((b, t), float(mask.sum())),
        "seq-mean-token-sum": torch.full((b, t), float(b)),
        "seq-mean-token-mean": mask.sum(-1, keepdim=True).expand(b, t) * b,
        "seq-mean-token-sum-norm": torch.full((b, t), float(b * t)),
    }[mode]
    score = torch.nn.functional.one_hot(sampled, vocab).double() - torch.softmax(z, -1)
    expected = -(weight / norm).reshape(-1, 1) * score
    torch.testing.assert_close(logits.grad.reshape(-1, vocab), expected, rtol=1e-6, atol=1e-9)
    assert set(metrics) == {
        "mask_frac",
        "out_of_region_frac",
        "mean_divergence",
        "ppo_kl",
        "disagreement_count",
    }
    keep = res.keep.reshape(b, t)
    assert metrics["mask_frac"] == pytest.approx(float(((~keep) * mask).sum() / mask.sum()))


def test_gradient_flows_only_through_log_pi_k():
    z, sampled, ids, lps, slp, adv = make_batch(n=10, vocab=20, k=3, seed=4)
    logits = z.clone().requires_grad_(True)
    loss, _ = policy_loss(logits, sampled, ids, lps, slp, adv, torch.ones(10), method="pdm", delta=1e6)
    (grad,) = torch.autograd.grad(loss, logits)
    res = compute_mask(z, sampled, ids, lps, slp, adv, delta=1e6)
    score = torch.nn.functional.one_hot(sampled, 20).double() - torch.softmax(z, -1)
    torch.testing.assert_close(grad, -(adv * res.ratio.double() / 10)[:, None] * score, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("cap", [10.0, None, math.inf])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_past_the_cap_grpo_dual_clips_a_negative_advantage_and_dppo_and_pdm_truncate_it(method, cap):
    """A = −1, r = π_k/μ_k = 20 (μ the rollout's), C = 10: GRPO's dual clip (VeRL's) makes the token's loss the
    constant −A·C = 10, no gradient, and masks it; DPPO and PDM keep it (δ above its D) and weight it by
    min(r, C): ∂L/∂log π_k = −A·min(r, C) = 10. Without a cap (None, or VeRL's inf) GRPO's loss is −A·r,
    ∂L/∂log π_k = 20, and DPPO's and PDM's weight is r = 20."""
    k = 2
    z = torch.tensor([[0.3, -0.2, 0.5, 0.1, -1.0, 0.0]], dtype=torch.float64)
    log_pi = torch.log_softmax(z, -1)
    slp = log_pi[:, k] - math.log(20.0)
    sampled, adv = torch.tensor([k]), torch.tensor([-1.0], dtype=torch.float64)
    logits = z.clone().requires_grad_(True)
    loss, metrics = policy_loss(logits, sampled, sampled[:, None], slp[:, None], slp, adv, torch.ones(1),
                                method=method, delta=1e6, ratio_cap=cap)  # fmt: skip
    loss.backward()
    res = compute_mask(
        z, sampled, sampled[:, None], slp[:, None], slp, adv, method=method, delta=1e6, ratio_cap=cap
    )
    assert float(res.ratio[0]) == pytest.approx(20.0, rel=1e-6)
    score = torch.nn.functional.one_hot(sampled, 6).double() - torch.softmax(z, -1)
    weight = 20.0 if cap in (None, math.inf) else 10.0  # ∂L/∂log π_k where the token has a gradient
    if method == "grpo" and weight == 10.0:
        assert float(loss.detach()) == pytest.approx(10.0)  # −A·C
        assert torch.equal(logits.grad, torch.zeros_like(z))
        assert not bool(res.keep[0]) and metrics["mask_frac"] == 1.0
        return
    assert bool(res.keep[0]) and metrics["mask_frac"] == 0.0
    value = 20.0 if method == "grpo" else weight * float(log_pi[0, k])  # −A·r, or −A·min(r, C)·log π_k
    assert float(loss.detach()) == pytest.approx(value, rel=1e-6)
    torch.testing.assert_close(logits.grad, weight * score, rtol=1e-6, atol=1e-12)


# ---------------------------------------------------------------------------
# Numerics
# ---------------------------------------------------------------------------


def _all_finite(res):
    return all(x is None or bool(torch.isfinite(x).all()) for x in (res.divergence, res.ddot, res.ratio))


@pytest.mark.parametrize("divergence", sorted(DIVERGENCES))
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_extreme_inputs_stay_finite(divergence, estimator):
    vocab = 12
    # π nearly one-hot, μ nearly one-hot on another token; huge logit range
    z = torch.full((4, vocab), -60.0)
    z[:, 0] = 60.0
    log_mu = torch.log_softmax(torch.where(torch.arange(vocab) == 3, 40.0, -40.0).expand(4, vocab), -1)
    cases = {
        "k_outside": (torch.tensor([5, 6, 7, 8]), 3),
        "k_is_top": (torch.tensor([3, 3, 3, 3]), 3),
        "K_ge_vocab": (torch.tensor([0, 1, 2, 3]), vocab + 4),
    }
    for sampled, k in cases.values():
        top = log_mu.topk(min(k, vocab), -1)
        ids, lps = _pad_topk(top.indices, top.values, max(k - vocab, 0))
        slp = log_mu.gather(-1, sampled[:, None]).squeeze(-1)
        for method in ("pdm", "dppo", "grpo"):
            res = compute_mask(z, sampled, ids, lps, slp, torch.tensor([1.0, -1.0, 0.5, -2.0]),
                               method=method, divergence=divergence, estimator=estimator)  # fmt: skip
            assert _all_finite(res)


def confident_batch(n, vocab, k, *, seed, drift, log10_gap=(5.0, 9.0)):
    """float32 logits of a confident policy: 1 − π_k = 10^−u, u uniform in `log10_gap`, k the sampled token;
    the rollout μ a drifted copy whose own 1 − μ_k spreads from about 1e-10 to 0.99 (median 1e-5 to 1e-4)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, dtype=torch.float64)
    gap = 10 ** -torch.empty(n, dtype=torch.float64).uniform_(*log10_gap, generator=g)
    z[:, 0] = torch.logsumexp(z[:, 1:], -1) + torch.log((1 - gap) / gap)  # π_0 = 1 − gap
    z_mu = z + drift * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    z_mu[:, 0] -= torch.empty(n, dtype=torch.float64).uniform_(-2.0, 12.0, generator=g)
    log_mu = torch.log_softmax(z_mu, -1)
    top = log_mu.topk(min(k, vocab), dim=-1)
    sampled = torch.zeros(n, dtype=torch.long)
    adv = torch.randn(n, generator=g)
    return z.float(), sampled, top.indices, top.values.float(), log_mu[:, 0].float(), adv


def reference64(z, sampled, ids, lps, slp, divergence, estimator):
    """D and Ḋ from MATH.md in float64 on the full vocabulary, π_tail and Q_tail summed over the unseen
    tokens (an independent float64 reference: softmax, the general Ḋ formula, no module internals)."""
    z = z.double()
    pi = torch.softmax(z, -1)
    n, vocab = z.shape
    rows = torch.arange(n)[:, None]
    support = torch.zeros(n, vocab, dtype=torch.bool)
    mu = torch.zeros(n, vocab, dtype=torch.float64)
    if DIVERGENCES[divergence].support == "topk":
        support[rows, ids] = True
        mu[rows, ids] = lps.double().exp()
    support[torch.arange(n), sampled] = True
    mu[torch.arange(n), sampled] = slp.double().exp()
    pi_tail = (pi * ~support).sum(-1).clamp_min(1e-12)
    mu_tail = (1 - (mu * support).sum(-1)).clamp_min(1e-12)
    q_tail = {
        "agg": pi_tail**2,
        "uni": pi_tail**2 / (vocab - support.sum(-1)).clamp_min(1),
        "exact": (pi**2 * ~support).sum(-1),
    }[estimator]
    q = (pi**2 * support).sum(-1) + q_tail
    pi_k = pi[torch.arange(n), sampled]
    if DIVERGENCES[divergence].family.name == "kl":
        d = torch.where(support & (mu > 0), mu * (mu.log() - pi.log()), 0.0).sum(-1)
        d = d + mu_tail * (mu_tail / pi_tail).log()
        g, g_tail = torch.where(support, -mu / pi, 0.0), -mu_tail / pi_tail
    else:
        d = 0.5 * (((mu - pi) * support).abs().sum(-1) + (mu_tail - pi_tail).abs())
        g, g_tail = torch.where(support, 0.5 * torch.sign(pi - mu), 0.0), 0.5 * torch.sign(pi_tail - mu_tail)
    g_k = g[torch.arange(n), sampled]
    ddot = (g_k * pi_k - (g * pi**2).sum(-1) - g_tail * q_tail
            - (pi_k - q) * ((g * pi).sum(-1) + g_tail * pi_tail))  # fmt: skip
    return d, ddot


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    vocab=st.integers(30, 3000),
    k=st.integers(1, 20),
    seed=st.integers(0, 100_000),
    drift=st.floats(0.0, 2.0),
    divergence=st.sampled_from(sorted(DIVERGENCES)),
    estimator=st.sampled_from(sorted(ESTIMATORS)),
)
def test_confident_policy_matches_a_float64_reference(vocab, k, seed, drift, divergence, estimator):
    """1 − π_k in [1e-9, 1e-5] with float32 logits: D and Ḋ within 2e-6 of float64 on the same logits,
    and `policy_loss` sees the very same D as `compute_mask`."""
    z, sampled, ids, lps, slp, adv = confident_batch(16, vocab, k, seed=seed, drift=drift)
    got = token_diagnostics(z, sampled, ids, lps, slp, adv, divergence=divergence, estimator=estimator)
    d_ref, ddot_ref = reference64(z, sampled, ids, lps, slp, divergence, estimator)
    torch.testing.assert_close(got.divergence.double(), d_ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(got.ddot.double(), ddot_ref, rtol=0, atol=2e-6)
    mask = torch.ones(len(sampled))
    _, metrics = policy_loss(z, sampled, ids, lps, slp, adv, mask, divergence=divergence, estimator=estimator)
    assert metrics == update_metrics(got, mask.bool())


def test_confident_policy_reproduction():
    """With a float32 normaliser this batch had D off by up to 4.4 and 136 of 4096 tokens on
    the wrong side of δ = 0.01 (one at D = 0.0272 where it is 0.0086, with 1 − π_k = 1.25e-6)."""
    z, sampled, ids, lps, slp, adv = confident_batch(4096, 1000, 5, seed=0, drift=0.5)
    got = token_diagnostics(z, sampled, ids, lps, slp, adv, method="dppo", delta=0.01)
    d_ref, _ = reference64(z, sampled, ids, lps, slp, "topk_kl", "agg")
    assert float((got.divergence.double() - d_ref).abs().max()) < 2e-6
    assert torch.equal(got.out_of_region, d_ref > 0.01)


def test_bfloat16_logits_match_float32():
    z, sampled, ids, lps, slp, adv = make_batch(n=64, vocab=100, k=10, seed=9, dtype=torch.float32)
    z16 = z.to(torch.bfloat16)
    ref = token_diagnostics(z16.float(), sampled, ids, lps.float(), slp.float(), adv.float(), delta=0.05)
    got = token_diagnostics(z16, sampled, ids, lps.float(), slp.float(), adv.float(), delta=0.05)
    assert got.divergence.dtype == torch.float32
    torch.testing.assert_close(got.divergence, ref.divergence)
    torch.testing.assert_close(got.ddot, ref.ddot)
    assert torch.equal(got.keep, ref.keep)


def test_no_vocab_sized_buffer():
    """compute_mask reads the logits in bounded blocks: no [N, V] allocation, no float64 copy.
    policy_loss allocates exactly one: the float32 log-softmax its gradient needs."""
    from torch.profiler import ProfilerActivity, profile

    from pdmctl.masks import rows

    n, vocab = 512, 65536  # 128 MB of float32 logits: eight blocks of scratch
    z, sampled, ids, lps, slp, adv = make_batch(n=n, vocab=vocab, k=20, seed=1, dtype=torch.float32)
    lps, slp, adv = lps.float(), slp.float(), adv.float()

    def big_allocations(fn) -> list[tuple[int, str]]:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return sorted(
            (e.self_cpu_memory_usage, e.name) for e in prof.events() if e.self_cpu_memory_usage > 1 << 20
        )

    for estimator in ("agg", "exact"):
        sizes = big_allocations(lambda e=estimator: compute_mask(z, sampled, ids, lps, slp, adv, estimator=e))
        assert sizes and all(size <= rows._CHUNK_ELEMENTS * 4 for size, _ in sizes), sizes
    sizes = big_allocations(
        lambda: policy_loss(z, sampled, ids, lps, slp, adv, torch.ones(n), estimator="exact")
    )
    assert [s for s in sizes if s[0] > rows._CHUNK_ELEMENTS * 4] == [
        (n * vocab * 4, "aten::_log_softmax")
    ], sizes


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def _good():
    z, sampled, ids, lps, slp, adv = make_batch(n=4, vocab=10, k=3, seed=0)
    return dict(
        logits=z, sampled_ids=sampled, rollout_topk_ids=ids, rollout_topk_logprobs=lps,
        rollout_sampled_logprobs=slp, advantages=adv,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        (lambda a: a.update(sampled_ids=a["sampled_ids"][:3]), "sampled_ids"),
        (
            lambda a: a.update(rollout_topk_logprobs=a["rollout_topk_logprobs"][:, :2]),
            "rollout_topk_logprobs",
        ),
        (lambda a: a.update(rollout_topk_ids=a["rollout_topk_ids"][:2]), "rollout_topk_ids"),
        (lambda a: a.update(advantages=a["advantages"][:2]), "advantages"),
        (lambda a: a["sampled_ids"].__setitem__(0, 10), "sampled_ids"),
        (lambda a: a["rollout_topk_ids"].__setitem__((0, 0), -1), "rollout_topk_ids"),
        (lambda a: a["logits"].__setitem__((1, 3), float("nan")), "logits"),
        (lambda a: a["advantages"].__setitem__(2, float("nan")), "advantages"),
        (lambda a: a.update(delta=0.0), "delta"),
        (lambda a: a.update(delta=-0.1), "delta"),
        (lambda a: a.update(delta_low=0.0), "delta_low"),
        (lambda a: a.update(method="ppo"), "method"),
        (lambda a: a.update(divergence="topk_js"), "divergence"),
        (lambda a: a.update(estimator="mean"), "estimator"),
    ],
)
def test_bad_input_names_the_argument(change, argument):
    args = _good()
    change(args)
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        compute_mask(**args)


def test_bad_loss_arguments():
    args = _good()
    with pytest.raises(ValueError, match=r"^loss_agg_mode:"):
        policy_loss(**args, response_mask=torch.ones(4), loss_agg_mode="sum")
    with pytest.raises(ValueError, match=r"^response_mask:"):
        policy_loss(**args, response_mask=torch.ones(5))
    for cap in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"^ratio_cap:"):
            policy_loss(**args, response_mask=torch.ones(4), ratio_cap=cap)
        with pytest.raises(ValueError, match=r"^ratio_cap:"):
            compute_mask(**args, ratio_cap=cap)


# ---------------------------------------------------------------------------
# vocabulary-parallel logits (Megatron TP): the same answer from the shards
# ---------------------------------------------------------------------------

SHARD_CASES = [(m, d, e) for m in METHODS for d in DIVERGENCES for e in ESTIMATORS]


def _sharded_diagnostics(rank: int, world: int, bounds: list[int], cases, dtype) -> list[dict]:
    """One rank: its columns of every case's logits, diagnosed through `VocabShard`."""
    from pdmctl.masks import VocabShard

    out = []
    for seed, (method, divergence, estimator) in enumerate(cases):
        z, sampled, ids, lps, slp, adv = make_batch(n=24, vocab=bounds[-1], k=6, seed=seed, dtype=dtype)
        if seed % 2:  # sampled tokens outside the top-K, and -inf padding the engine did not return
            z, sampled, ids, lps, slp, adv = make_batch(n=24, vocab=bounds[-1], k=6, seed=seed, dtype=dtype,
                                                        k_outside=True)  # fmt: skip
            lps = lps.clone()
            lps[::3, -2:] = -math.inf
        shard = VocabShard(start=bounds[rank], vocab_size=bounds[-1])
        d = token_diagnostics(
            z[:, bounds[rank] : bounds[rank + 1]].contiguous(), sampled, ids, lps, slp, adv, method=method,
            divergence=divergence, estimator=estimator, delta=0.05, shard=shard,
        )  # fmt: skip
        full = token_diagnostics(
            z,
            sampled,
            ids,
            lps,
            slp,
            adv,
            method=method,
            divergence=divergence,
            estimator=estimator,
            delta=0.05,
        )
        out.append({"sharded": d, "full": full})
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_vocab_parallel_shards_give_the_whole_vocabulary_answer(dtype):
    from tests.distributed import run_group

    bounds = [0, 17, 34, 50]  # three uneven shards of V = 50
    results = run_group(_sharded_diagnostics, 3, bounds, SHARD_CASES, dtype)
    tol = (
        {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    )  # float32 sums
    masked = 0
    for rank_result in results:
        for case, pair in zip(SHARD_CASES, rank_result, strict=True):
            d, full = pair["sharded"], pair["full"]
            assert torch.equal(d.keep, full.keep), case
            assert torch.equal(d.out_of_region, full.out_of_region), case
            for name in ("divergence", "ddot", "ratio", "log_ratio"):
                torch.testing.assert_close(
                    getattr(d, name),
                    getattr(full, name),
                    **tol,
                    msg=lambda m, c=case, n=name: f"{c} {n}: {m}",
                )
            masked += int((~d.keep).sum())
    assert masked > 0  # some tokens are masked, so the comparison of the decisions is not vacuous


def test_vocab_shard_outside_the_vocabulary_is_refused():
    from pdmctl.masks import VocabShard

    z, sampled, ids, lps, slp, adv = make_batch(n=4, vocab=10, k=3)
    with pytest.raises(ValueError, match="shard: columns"):
        token_diagnostics(z, sampled, ids, lps, slp, adv, shard=VocabShard(start=5, vocab_size=10))


def _sharded_confident(rank: int, world: int, bounds: list[int]) -> list[dict]:
    from pdmctl.masks import VocabShard

    z, sampled, ids, lps, slp, adv = confident_batch(32, bounds[-1], 6, seed=3, drift=0.5)
    shard = VocabShard(start=bounds[rank], vocab_size=bounds[-1])
    out = []
    for divergence, estimator in (("topk_kl", "exact"), ("topk_tv", "agg"), ("binary_kl", "uni")):
        d = token_diagnostics(z[:, bounds[rank] : bounds[rank + 1]].contiguous(), sampled, ids, lps, slp, adv,
                              divergence=divergence, estimator=estimator, shard=shard)  # fmt: skip
        out.append({"case": (divergence, estimator), "divergence": d.divergence, "ddot": d.ddot})
    return out


def test_vocab_parallel_shards_keep_a_confident_policy_precise():
    """The shards' tail sums, reduced over the group, are as precise as the whole row's: within 2e-6 of float64."""
    from tests.distributed import run_group

    bounds = [0, 301, 640, 1000]  # the confident token (id 0) on rank 0, its support spread over all three
    z, sampled, ids, lps, slp, _ = confident_batch(32, bounds[-1], 6, seed=3, drift=0.5)
    for rank_result in run_group(_sharded_confident, 3, bounds):
        for case in rank_result:
            d_ref, ddot_ref = reference64(z, sampled, ids, lps, slp, *case["case"])
            torch.testing.assert_close(case["divergence"].double(), d_ref, rtol=0, atol=2e-6)
            torch.testing.assert_close(case["ddot"].double(), ddot_ref, rtol=0, atol=2e-6)
