"""The counterfactual protocol: the batched pairs of updates equal the direct ones."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from pdmctl.analysis import counterfactual as cf
from pdmctl.backends.toy import ToyConfig, task
from pdmctl.backends.toy.probe import diagnostics, stale_batch


def _same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_same_state(a[k], b[k]) if isinstance(a[k], dict) else
               torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)  # fmt: skip


def _close(batched: cf.Effects, reference: cf.Effects, idx) -> str | None:
    """The first field where the batched effects differ from the direct ones by more than float32 rounding
    of the update allows, else None. The two paths sum the same float32 terms in another order, so they
    agree to a few float32 ulps of D itself: 1e-6 plus 1e-5 of the token's larger |D| (about 80 ulps).
    Measured: up to 1.6e-6 on D = 1.33 (toy-fork, fp8_rollout; AMD EPYC, AVX512 and AVX2 kernels), where a
    fixed 1e-6 failed; a wrong update changes D by percents."""
    scale = torch.maximum(reference.d_keep.abs(), reference.d_mask.abs())
    tolerance = 1e-6 + 1e-5 * scale
    for field in ("d_keep", "d_mask", "own", "region"):
        gap = (getattr(batched, field)[idx] - getattr(reference, field)).abs()
        if not (gap <= tolerance).all():
            return f"{field}: gaps {gap.tolist()} over {tolerance.tolist()}"
    return None


@pytest.fixture(autouse=True)
def one_thread():
    """One thread for these comparisons, and the process's count back afterwards: a count left at 1 changed
    what later tests in the same process trained (a 20-step GRPO run: 0.595 -> 0.579 held-out)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_batched_counterfactual_equals_the_direct_updates() -> None:
    """For a few out-of-region tokens, kept and masked, each criterion's D_j(keep) − D_j(mask) and the
    region's mean effect from the batched variants (per-token gradients, stacked Adam steps) equal those of
    two whole direct updates each (loss with the token's mask flipped, backward, clip_grad_norm_,
    optimizer.step on a copy of the carried state); the learner's weights and Adam state are untouched."""
    cfg = ToyConfig(seed=5, prompts_per_step=16)
    learner, batch, advantages = stale_batch(cfg)
    pre = diagnostics(learner, batch, advantages, cfg, "agg")
    outside = pre.out_of_region & task.response_mask(batch.sampled_ids).bool()
    rows, cols = outside.nonzero(as_tuple=True)
    criteria = {"ratio": dataclasses.replace(cfg, method="dppo"),
                "predictive/exact": dataclasses.replace(cfg, method="pdm", estimator="exact")}  # fmt: skip
    weights = copy.deepcopy(learner.policy.state_dict())
    state = copy.deepcopy(learner.optimizer.state_dict())
    assert state["state"] and int(state["state"][0]["step"]) == cfg.minibatches - 1  # a carried Adam state
    batched = cf.counterfactual_effects(learner, batch, advantages, criteria, rows, cols)
    assert _same_state(learner.optimizer.state_dict(), state) and _same_state(learner.policy.state_dict(), weights)
    # tokens the criteria keep and mask, all with A ≠ 0
    a = advantages[rows]
    kept, masked = (batched["predictive/exact"].kept & (a != 0)), (~batched["predictive/exact"].kept & (a != 0))
    picked = kept.nonzero().squeeze(1)[:2].tolist() + masked.nonzero().squeeze(1)[:2].tolist()
    assert len(picked) == 4 and batched["ratio"].kept[picked].any() and not batched["ratio"].kept[picked].all()
    reference = cf.counterfactual_effects_reference(learner, batch, advantages, criteria, rows, cols, picked)
    assert _same_state(learner.optimizer.state_dict(), state) and _same_state(learner.policy.state_dict(), weights)
    idx = torch.tensor(picked)
    for name in criteria:
        b, r = batched[name], reference[name]
        assert torch.equal(b.kept[idx], r.kept)
        assert _close(b, r, idx) is None, (name, _close(b, r, idx))  # D to float32 rounding of the update
        assert (r.own.abs() > 1e-5).all()  # effects far above the rounding: the same signs
        assert torch.equal(b.own[idx] > 0, r.own > 0)


def test_adam_rows_is_the_optimizer_step_bit_for_bit() -> None:
    """Each stacked variant's update is the carried Adam's own step, to the bit, from a copy of the state."""
    cfg = ToyConfig(seed=3, prompts_per_step=8)
    learner, _, _ = stale_batch(cfg)
    layout = cf._flat_names(learner.policy)
    theta0 = torch.cat([p.detach().reshape(-1) for p in learner.policy.parameters()])
    m0, v0, step0, group = cf._adam_state(learner, layout)
    grads = torch.randn(3, theta0.numel(), generator=torch.Generator().manual_seed(0)) * 1e-2
    stacked = cf.adam_rows(theta0, grads, m0, v0, step0, group)
    for i in range(3):
        optimizer = torch.optim.Adam(learner.policy.parameters(), lr=cfg.lr)
        optimizer.load_state_dict(copy.deepcopy(learner.optimizer.state_dict()))
        for p, (_, _, sl) in zip(learner.policy.parameters(), layout, strict=True):
            with torch.no_grad():
                p.copy_(theta0[sl].reshape(p.shape))
            p.grad = grads[i, sl].reshape(p.shape).clone()
        optimizer.step()
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in learner.policy.parameters()]), stacked[i])
    assert torch.equal(m0, cf._adam_state(learner, layout)[0])  # the carried state was copied, not moved


@pytest.mark.parametrize(
    ("model", "precision", "prompts"), [("toy-small", "fp8_e2e", 16), ("toy-llm", "bf16", 4), ("toy-fork", "fp8_rollout", 4)]
)
def test_batched_counterfactual_on_fp8_weights_and_the_llm_preset(model: str, precision: str, prompts: int) -> None:
    """The same equality through fp8 training weights (a per-tensor scale: the whole embedding is laid out,
    not its read rows) and on the LLM-like preset (19-token responses, its own vocabulary): two tokens."""
    cfg = ToyConfig(seed=5, prompts_per_step=prompts, precision=precision, model=model)
    learner, batch, advantages = stale_batch(cfg)
    pre = diagnostics(learner, batch, advantages, cfg, "agg")
    rows, cols = (pre.out_of_region & task.response_mask(batch.sampled_ids).bool()).nonzero(as_tuple=True)
    picked = [i for i in range(len(rows)) if advantages[rows[i]] != 0][:2]
    variants = torch.zeros(len(rows), dtype=torch.bool)
    variants[picked] = True
    criteria = {"ratio": dataclasses.replace(cfg, method="dppo")}
    batched = cf.counterfactual_effects(learner, batch, advantages, criteria, rows, cols, variants=variants)["ratio"]
    assert batched.own[~variants].isnan().all() and not batched.own[variants].isnan().any()
    reference = cf.counterfactual_effects_reference(learner, batch, advantages, criteria, rows, cols, picked)["ratio"]
    assert _close(batched, reference, picked) is None, _close(batched, reference, picked)
