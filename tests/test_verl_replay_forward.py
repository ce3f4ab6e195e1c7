"""The engine replay's forward: the snapshot names the samples of each of VeRL's packed micro-batch forwards,
and the replay runs those forwards (sequences end to end, positions restarting) without one sequence seeing
another. That the replay then gives VeRL's own gradients bit for bit is checked inside the engine
(tests/test_verl_engine.py)."""

from __future__ import annotations

import pytest
import torch

from pdmctl.analysis.engine.replay import Replay, SnapshotError
from pdmctl.backends.verl.snapshot import micro_batches


def _packed(*pieces: torch.Tensor, mrope: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat(pieces)[None]
    positions = torch.cat([torch.arange(len(p)) for p in pieces])[None]
    return ids, (positions[None].expand(3, 1, -1) if mrope else positions)


SAMPLES = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 4])]


@pytest.mark.parametrize("mrope", [False, True])
def test_each_packed_forward_names_its_samples_in_order(mrope: bool) -> None:
    """Two forwards, each a row of sequences end to end: each sequence is matched to one sample, identical
    samples once each, in the row's order; multimodal rotary positions ([3, 1, L]) read alike."""
    forwards = [_packed(SAMPLES[3], SAMPLES[0], mrope=mrope), _packed(SAMPLES[1], SAMPLES[2], mrope=mrope)]
    assert micro_batches(forwards, SAMPLES) == [[3, 0], [1, 2]]


def test_forwards_that_are_not_packed_rows_of_the_samples_are_not_recorded() -> None:
    """Padded rows, a row without positions, a padding tail that is no sample, a sample left out: no
    record (the replay then runs each sequence alone, and says so)."""
    padded = torch.stack([torch.tensor([0, 5, 6, 7]), torch.tensor([1, 2, 3, 4])])
    ids, positions = _packed(SAMPLES[0], SAMPLES[1])
    tail_ids = torch.cat([ids, torch.zeros(1, 3, dtype=ids.dtype)], 1)
    tail_positions = torch.cat([positions, torch.zeros(1, 3, dtype=positions.dtype)], 1)
    for forwards in (
        [(padded, torch.arange(4).expand(2, 4))],
        [(ids, None)],
        [(tail_ids, tail_positions), _packed(SAMPLES[2], SAMPLES[3])],
        [_packed(SAMPLES[0], SAMPLES[1])],
        [],
    ):
        assert micro_batches(forwards, SAMPLES) is None


def _tiny_snapshot(lengths: list[int]) -> tuple[dict, torch.nn.Module]:
    """A 2-layer Qwen3 of random weights and a snapshot-shaped record of `len(lengths)` sequences (the last
    two tokens of each the response)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = [torch.randint(1, 64, (n,)) for n in lengths]
    response = [torch.tensor([1, 1, 0, 0]) for _ in lengths]  # right-padded to the response width, as VeRL's
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    snapshot = {
        "weights_before": weights, "weights_after": weights, "grads": weights,
        "optimizer": {"class": "AdamW", "clip_grad": 1.0, "state": {},
                      "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}]},
        "batch": {"input_ids": ids, "response_mask": response,
                  "rollout_log_probs": [torch.full((4,), -1.0) for _ in lengths],
                  "advantages": [torch.ones(4) for _ in lengths],
                  "topk_ids": [torch.zeros(4, 2, dtype=torch.long) for _ in lengths],
                  "topk_logprobs": [torch.full((4, 2), -2.0) for _ in lengths]},
        "settings": {"use_kl_loss": False, "entropy_coeff": 0.0, "loss_agg_mode": "token-mean", "temperature": 1.0,
                     "dp_size": 1, "batch_num_tokens": 2 * len(lengths), "log_probs_from": "log_softmax",
                     "mask": {"method": "pdm"}},
    }  # fmt: skip
    return snapshot, model


def test_a_packed_forward_keeps_each_sequence_to_itself() -> None:
    """Three sequences packed in one forward give each the logits it has alone, to bf16's precision (one
    sequence attending to another's tokens moves them by far more), and a one-sequence forward gives
    the sequence's own bf16 forward bit for bit."""
    snapshot, model = _tiny_snapshot([9, 6, 11])
    alone = Replay({**snapshot, "micro_batches": None}, model)
    weights = alone.weights("weights_before")
    own = alone.logits(weights, "bf16")
    singles = Replay({**snapshot, "micro_batches": [[0], [1], [2]]}, model).logits(weights, "bf16")
    assert all(torch.equal(a, b) for a, b in zip(own, singles, strict=True))
    packed = Replay({**snapshot, "micro_batches": [[2, 0, 1]]}, model).logits(weights, "bf16")
    scale = max(float(z.abs().max()) for z in own)
    worst = max(float((a - b).abs().max()) for a, b in zip(own, packed, strict=True))
    bound = 4 * 2**-8 * scale  # a few bf16 ulps of the largest logit
    assert worst <= bound, (worst, scale)
    # the same three end to end with one causal mask over the whole row: the later sequences see the first
    x = alone.samples
    joined = torch.cat([x[2].input_ids, x[0].input_ids])[None]
    with torch.no_grad():
        leaked = model(joined, use_cache=False).logits[0, len(x[2].input_ids) + x[0].rows].float()
    print(f"packed vs alone {worst:.3g}, leaked {float((leaked - own[0]).abs().max()):.3g}, bound {bound:.3g}")
    assert float((leaked - own[0]).abs().max()) > 4 * bound


@pytest.mark.parametrize("packed", [[[0], [0, 1]], [[0, 1], [2]], [[1]]])
def test_micro_batches_that_do_not_hold_each_sample_once_are_refused(packed: list[list[int]]) -> None:
    snapshot, model = _tiny_snapshot([5, 6])
    with pytest.raises(SnapshotError, match="do not hold its 2 samples once each"):
        Replay({**snapshot, "micro_batches": packed}, model)
