"""pdmctl's losses inside VeRL's own loss path (verl==0.9.1 on CPU).

The actor's two calls are made exactly as VeRL's FSDP engine makes them
(`prepare_model_outputs`: logits processor on the packed rows, then the loss on
`model_output`), on a micro-batch built the way VeRL's trainer builds it
(`left_right_2_no_padding`), with VeRL's ActorConfig from VeRL's Hydra config.
"""

from __future__ import annotations

import functools
import math

import pytest

pytest.importorskip("verl")

import torch
from tensordict import TensorDict
from verl import DataProto
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.torch_functional import logprobs_from_logits
from verl.workers.utils.padding import left_right_2_no_padding

from pdmctl import masks
from pdmctl.backends.verl import actor_loss, launch, plugin, topk

pytestmark = pytest.mark.verl

VOCAB, K = 48, 4
PROMPT_LENS, RESPONSE_LENS = [3, 5, 2], [6, 4, 7]
P, R = max(PROMPT_LENS), max(RESPONSE_LENS)
CASES = [
    ("pdm", "topk_kl", "agg"),
    ("pdm", "topk_tv", "exact"),
    ("pdm", "topk_kl", "uni"),
    ("dppo", "topk_kl", "agg"),
    ("dppo", "binary_tv", "agg"),
    ("grpo", "topk_kl", "agg"),
]


@functools.cache  # Hydra composes in ~2 s; the config is read, never changed
def actor_config(method: str, divergence: str, estimator: str, loss_agg_mode: str = "token-mean",
                 ratio_cap: float | None = 5.0):
    run = {
        "model": "qwen3-4b-base", "strategy": "fsdp2", "method": method, "divergence": divergence, "estimator": estimator,
        "k": K, "delta": 0.05, "ratio_cap": ratio_cap, "loss_agg_mode": loss_agg_mode,
        "checkpoint_dir": "/ck", "data_dir": "/data",
    }  # fmt: skip
    config = launch.compose(launch.verl_overrides(run))
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def micro_batch(seed: int, layout: str = "carried"):
    """A left/right padded batch as VeRL's trainer holds it, then VeRL's own no-padding conversion.

    The top-K as the batch carries it (`carried`: each response's `[T_i, K]` from `topk.carry_topk`, in
    the DataProto's non_tensor_batch, through VeRL's own `to_tensordict`), or as it did until 634251f
    (`padded`: `[bsz, R, K+1]` tensors). The same seed gives the same rollout, training logits and
    tokens either way."""
    g = torch.Generator().manual_seed(seed)
    bsz = len(PROMPT_LENS)
    prompts = torch.zeros(bsz, P, dtype=torch.long)
    responses = torch.zeros(bsz, R, dtype=torch.long)
    attention = torch.zeros(bsz, P + R, dtype=torch.long)
    response_mask = torch.zeros(bsz, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        prompts[i, P - p :] = torch.randint(0, VOCAB, (p,), generator=g)
        responses[i, :r] = torch.randint(0, VOCAB, (r,), generator=g)
        attention[i, P - p : P + r] = 1
        response_mask[i, :r] = 1
    # The rollout policy μ: a random softmax; its top-K plus the sampled token (slot K) when outside.
    mu_logits = torch.randn(bsz, R, VOCAB, generator=g) * 2
    mu_logp = torch.log_softmax(mu_logits, -1)
    top_lp, top_ids = mu_logp.topk(K, dim=-1)
    in_top = (top_ids == responses.unsqueeze(-1)).any(-1)
    extra_ids = torch.where(in_top, 0, responses).unsqueeze(-1)
    extra_lp = torch.where(
        in_top, -math.inf, mu_logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    ).unsqueeze(-1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp_min(0),
        "response_mask": response_mask,
        "advantages": torch.randn(bsz, 1, generator=g).expand(bsz, R).contiguous() * response_mask,
        "old_log_probs": mu_logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1),
        "rollout_log_probs": mu_logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1),
    }
    padded_ids, padded_lp = torch.cat([top_ids, extra_ids], -1), torch.cat([top_lp, extra_lp], -1)
    if layout == "padded":
        data = TensorDict({**tensors, topk.TOPK_IDS_KEY: padded_ids, topk.TOPK_LOGPROBS_KEY: padded_lp}, [bsz])
    elif layout == "carried":
        supports = [topk.RolloutTopK(padded_ids[i, :r], padded_lp[i, :r]) for i, r in enumerate(RESPONSE_LENS)]
        ids, lps = topk.carry_topk(supports, responses, response_mask, tensors["rollout_log_probs"], K)
        proto = DataProto.from_dict(tensors, non_tensors={topk.TOPK_IDS_KEY: ids, topk.TOPK_LOGPROBS_KEY: lps})
        data = proto.to_tensordict()
    else:
        raise ValueError(layout)
    data = left_right_2_no_padding(data)
    n_tokens = int(response_mask.sum())
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=n_tokens, global_batch_size=bsz)
    # The training policy π: μ's logits moved a little, so some tokens leave the trust region.
    packed = int(attention.sum())
    logits = torch.randn(packed, VOCAB, generator=g, dtype=torch.float64)
    rows = actor_loss.response_rows(data, packed)
    valid = response_mask.bool()
    logits[rows[valid]] = mu_logits[valid].double() + 0.7 * torch.randn(n_tokens, VOCAB, generator=g).double()
    return data, logits, rows, valid


def verl_actor_step(config, data, logits: torch.Tensor):
    """What FSDPEngineWithLMHead.prepare_model_outputs + forward_step do with a pdmctl loss."""
    cu_seqlens = data["input_ids"].offsets()
    labels = torch.roll(data["input_ids"].values(), shifts=-1, dims=0)
    processed = actor_loss.pdm_ppo_loss(config, data=data, student_logits=logits.unsqueeze(0))
    model_output = {
        name: torch.nested.nested_tensor_from_jagged(v.squeeze(0), cu_seqlens)
        for name, v in processed.items()
    }
    log_probs = logprobs_from_logits(logits=logits, labels=labels, inplace_backward=False)
    model_output["log_probs"] = torch.nested.nested_tensor_from_jagged(log_probs, cu_seqlens)
    return actor_loss.pdm_ppo_loss(config, model_output=model_output, data=data)


@pytest.mark.parametrize(("method", "divergence", "estimator"), CASES)
def test_loss_through_verl_equals_policy_loss(method: str, divergence: str, estimator: str) -> None:
    config = actor_config(method, divergence, estimator)
    assert isinstance(config.policy_loss, plugin.PdmPolicyLossConfig)
    assert get_policy_loss_fn(config.policy_loss.loss_mode) is not None
    for seed in range(3):
        data, logits, rows, valid = micro_batch(seed)
        leaf = logits.clone().requires_grad_(True)
        loss, metrics = verl_actor_step(config, data, leaf)
        loss.backward()

        ref_leaf = logits.clone().requires_grad_(True)
        padded = micro_batch(seed, layout="padded")[0]
        ref_loss, ref_metrics = masks.policy_loss(
            ref_leaf[rows], data["responses"], padded[topk.TOPK_IDS_KEY], padded[topk.TOPK_LOGPROBS_KEY],
            data["rollout_log_probs"], data["advantages"], valid.float(), method=method, divergence=divergence,
            estimator=estimator, delta=0.05, eps_low=0.2, eps_high=0.28, ratio_cap=5.0,
        )  # fmt: skip
        ref_loss.backward()

        torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-5, atol=1e-9)
        for name, value in ref_metrics.items():
            assert metrics[f"actor/pdmctl/{name}"].values[0] == pytest.approx(value, rel=1e-6, abs=1e-9)
        assert metrics["actor/pg_clipfrac"].values[0] == pytest.approx(ref_metrics["mask_frac"])


@pytest.mark.parametrize(("method", "divergence", "estimator"), CASES)
def test_the_carried_layout_gives_the_padded_layouts_mask_and_loss_bit_for_bit(
    method: str, divergence: str, estimator: str, monkeypatch
) -> None:
    """The same rollout and logits through the padded layout read as it was read until
    634251f (tests/topk_reference.py) and through the carried one (`[T_i, K]` int32 per response, slot K
    rebuilt): every diagnostic of the logits processor, the loss, its gradient and VeRL's metrics equal."""
    from tests.topk_reference import reference_response_tokens

    config = actor_config(method, divergence, estimator)
    for seed in range(2):
        results = []
        for layout in ("padded", "carried"):
            data, logits, _, _ = micro_batch(seed, layout=layout)
            with monkeypatch.context() as patch:
                if layout == "padded":
                    patch.setattr(actor_loss, "response_tokens", reference_response_tokens)
                outputs = actor_loss.pdm_ppo_loss(config, data=data, student_logits=logits.unsqueeze(0))
                leaf = logits.clone().requires_grad_(True)
                loss, metrics = verl_actor_step(config, data, leaf)
            loss.backward()
            results.append((outputs, loss, leaf.grad, metrics))
        (padded_out, padded_loss, padded_grad, padded_metrics), (out, loss, grad, metrics) = results
        assert padded_out.keys() == out.keys()
        for name, value in padded_out.items():
            assert torch.equal(out[name], value), name
        assert torch.equal(loss, padded_loss) and torch.equal(grad, padded_grad)
        assert {k: v.values for k, v in metrics.items()} == {k: v.values for k, v in padded_metrics.items()}
    kept = padded_out[topk._OUTPUT_PREFIX + "keep"]
    assert method == "grpo" or bool((kept == 0).any()), "some token masked: the comparison is not vacuous"


def test_some_tokens_are_masked_so_the_comparison_is_not_vacuous() -> None:
    data, logits, rows, valid = micro_batch(0, layout="padded")
    d = masks.token_diagnostics(
        logits[rows[valid]], data["responses"][valid], data[topk.TOPK_IDS_KEY][valid],
        data[topk.TOPK_LOGPROBS_KEY][valid], data["rollout_log_probs"][valid], data["advantages"][valid],
        method="pdm", divergence="topk_kl", estimator="agg", delta=0.05,
    )  # fmt: skip
    assert 0 < int((~d.keep).sum()) < int(valid.sum())


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_sequence_aggregation_modes_match(mode: str) -> None:
    config = actor_config("pdm", "topk_kl", "agg", loss_agg_mode=mode)
    data, logits, rows, valid = micro_batch(1)
    loss, _ = verl_actor_step(config, data, logits)
    padded = micro_batch(1, layout="padded")[0]
    ref, _ = masks.policy_loss(
        logits[rows], data["responses"], padded[topk.TOPK_IDS_KEY], padded[topk.TOPK_LOGPROBS_KEY],
        data["rollout_log_probs"], data["advantages"], valid.float(), method="pdm", divergence="topk_kl",
        delta=0.05, ratio_cap=5.0, loss_agg_mode=mode,
    )  # fmt: skip
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-6, atol=1e-9)


def test_every_method_is_registered_under_its_pdmctl_name() -> None:
    assert sorted(plugin.registered_losses()) == sorted(f"pdmctl_{m}" for m in masks.METHODS)


def test_loss_outside_pdmctl_actor_loss_fails_clearly() -> None:
    fn = get_policy_loss_fn("pdmctl_pdm")
    z = torch.zeros(1, 2)
    with pytest.raises(RuntimeError, match="top-K patch is not"):
        fn(old_log_prob=z, log_prob=z, advantages=z, response_mask=z, config=None)


def test_policy_loss_config_rejects_unknown_divergence() -> None:
    with pytest.raises(ValueError, match="divergence"):
        plugin.PdmPolicyLossConfig(loss_mode="pdmctl_pdm", divergence="nope")


def test_the_mask_profile_has_one_line_per_logits_processor_call(tmp_path, monkeypatch) -> None:
    """bench/engine.py's source for the mask's share of the actor step: with the profile directory
    set, every call of the logits processor appends its response tokens and seconds."""
    import json

    config = actor_config("pdm", "topk_kl", "agg")
    data, logits, _, valid = micro_batch(2)
    monkeypatch.setenv(topk.PROFILE_ENV, str(tmp_path / "profile"))
    for _ in range(2):
        verl_actor_step(config, data, logits)
    (log,) = (tmp_path / "profile").iterdir()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["rows"] for line in lines] == [int(valid.sum())] * 2
    assert all(0 < line["s"] < 60 for line in lines)


@pytest.mark.parametrize("method", ["pdm", "dppo"])
def test_a_run_without_a_ratio_cap_trains_on_the_uncapped_loss_through_verl(method: str) -> None:
    """`mask.ratio_cap: null` (the paper's loss for PDM and DPPO) reaches VeRL as clip_ratio_c=inf, and the
    loss and gradient through VeRL's loss path are `policy_loss` with no cap, L = −A · sg(r) · M · log π_k;
    with a cap below some kept token's ratio the same batch gives another loss (the cap is not a no-op)."""
    config = actor_config(method, "topk_kl", "agg", ratio_cap=None)
    assert config.clip_ratio_c == math.inf
    data, logits, rows, valid = micro_batch(0)
    leaf = logits.clone().requires_grad_(True)
    loss, _ = verl_actor_step(config, data, leaf)
    loss.backward()
    padded = micro_batch(0, layout="padded")[0]

    def reference(cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        ref_leaf = logits.clone().requires_grad_(True)
        ref, _ = masks.policy_loss(
            ref_leaf[rows], data["responses"], padded[topk.TOPK_IDS_KEY], padded[topk.TOPK_LOGPROBS_KEY],
            data["rollout_log_probs"], data["advantages"], valid.float(), method=method, divergence="topk_kl",
            estimator="agg", delta=0.05, ratio_cap=cap,
        )  # fmt: skip
        ref.backward()
        return ref, ref_leaf.grad

    uncapped, uncapped_grad = reference(None)
    torch.testing.assert_close(loss.double(), uncapped.double(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(leaf.grad, uncapped_grad, rtol=1e-5, atol=1e-9)
    capped, _ = reference(1.0)
    assert not torch.isclose(capped.double(), uncapped.double(), rtol=1e-6, atol=1e-9)
