"""vLLM-shaped rollout outputs -> the padded top-K tensors the actor reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

pytest.importorskip("verl")

import torch

from pdmctl.backends.verl import topk

pytestmark = pytest.mark.verl


@dataclass
class Logprob:  # the fields of vllm.sequence.Logprob
    logprob: float
    rank: int | None
    decoded_token: str | None = None


def position(entries: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
    return {tid: Logprob(lp, rank) for tid, (lp, rank) in entries.items()}


def test_sampled_token_inside_top_k_is_not_duplicated() -> None:
    # dict order is not rank order: vLLM puts the sampled token first
    out = topk.extract_topk([7], [position({7: (-1.2, 2), 3: (-0.5, 1), 9: (-2.0, 3)})], k=3)
    assert out.ids.tolist() == [[3, 7, 9, 0]]
    assert out.logprobs[0, :3].tolist() == pytest.approx([-0.5, -1.2, -2.0])
    assert out.logprobs[0, 3] == -math.inf


def test_sampled_token_outside_top_k_goes_to_slot_k_plus_one() -> None:
    out = topk.extract_topk([42], [position({42: (-6.0, 17), 1: (-0.1, 1), 2: (-2.5, 2)})], k=2)
    assert out.ids.tolist() == [[1, 2, 42]]
    assert out.logprobs[0].tolist() == pytest.approx([-0.1, -2.5, -6.0])


def test_k_larger_than_returned_pads_with_minus_inf() -> None:
    out = topk.extract_topk([5, 6], [position({5: (-0.2, 1), 8: (-1.9, 2)}), position({6: (0.0, 1)})], k=4)
    assert out.ids.shape == (2, 5)
    assert out.ids[0, :2].tolist() == [5, 8]
    assert torch.isinf(out.logprobs[0, 2:]).all()
    assert out.ids[1, 0] == 6 and torch.isinf(out.logprobs[1, 1:]).all()


def test_entries_ranked_beyond_k_are_not_top_k() -> None:
    # a vLLM that returned more than K (max_logprobs > K) must not widen the support
    out = topk.extract_topk([1], [position({1: (-0.1, 1), 2: (-1.0, 2), 3: (-3.0, 3)})], k=2)
    assert out.ids.tolist() == [[1, 2, 0]]


def test_missing_sampled_logprob_is_an_error() -> None:
    with pytest.raises(ValueError, match="sampled token"):
        topk.extract_topk([99], [position({1: (-0.1, 1)})], k=1)


def test_pad_to_response_length() -> None:
    a = topk.extract_topk([1, 2], [position({1: (-0.1, 1)}), position({2: (-0.2, 1)})], k=2)
    b = topk.extract_topk([3], [position({3: (-0.3, 1)})], k=2)
    padded = topk.pad_topk([a, b], response_length=4, k=2)
    assert padded.ids.shape == padded.logprobs.shape == (2, 4, 3)
    assert padded.ids[1, 0, 0] == 3 and torch.isinf(padded.logprobs[1, 1:]).all()
    assert padded.logprobs.dtype == torch.float32 and padded.ids.dtype == torch.int64


def test_version_pin() -> None:
    topk.check_verl_version()  # the installed, pinned verl
    with pytest.raises(topk.VerlVersionError, match=r"verl==0\.9\.1"):
        topk.check_verl_version("0.10.0")


def test_install_patches_actor_and_agent_loop_idempotently() -> None:
    from verl.experimental.agent_loop import agent_loop
    from verl.workers import engine_workers

    topk.install(k=4)
    patched = engine_workers.TrainingWorker.train_batch
    topk.install(k=4)
    assert engine_workers.TrainingWorker.train_batch is patched
    assert agent_loop.AgentLoopWorker._postprocess.__wrapped__ is not None


def _internal_output(
    prompt: list[int], response: list[int], prompt_len: int, response_len: int, k: int, seed: int
):
    """What VeRL's `_agent_loop_postprocess` hands `_postprocess`, with the vLLM patch's extra fields."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, _InternalAgentLoopOutput

    g = torch.Generator().manual_seed(seed)
    positions = []
    for sampled in response:  # vLLM: the top-k by rank, plus the sampled token when outside them
        lps = torch.log_softmax(torch.randn(12, generator=g), -1)
        order = lps.argsort(descending=True).tolist()
        entries = {tid: Logprob(float(lps[tid]), r + 1) for r, tid in enumerate(order[:k])}
        entries.setdefault(sampled, Logprob(float(lps[sampled]), order.index(sampled) + 1))
        positions.append(entries)
    support = topk.extract_topk(response, positions, k)
    prompt_ids = torch.tensor([[0] * (prompt_len - len(prompt)) + prompt])
    response_ids = torch.tensor([response + [0] * (response_len - len(response))])
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - len(prompt)).long()[None]
    response_mask = (torch.arange(response_len) < len(response)).long()[None]
    attention = torch.cat([prompt_mask, response_mask], 1)
    return _InternalAgentLoopOutput(
        prompt_ids=prompt_ids, response_ids=response_ids, input_ids=torch.cat([prompt_ids, response_ids], 1),
        position_ids=(attention.cumsum(-1) - 1).clamp_min(0), response_mask=response_mask, attention_mask=attention,
        response_logprobs=torch.zeros(1, response_len), num_turns=2, metrics=AgentLoopMetrics(),
        extra_fields={topk.TOPK_IDS_KEY: support.ids.tolist(), topk.TOPK_LOGPROBS_KEY: support.logprobs.tolist(),
                      "turn_scores": [], "tool_rewards": []},
    )  # fmt: skip


def test_agent_loop_patch_puts_padded_top_k_in_the_batch() -> None:
    """VeRL's own `AgentLoopWorker._postprocess`, patched, on outputs shaped as VeRL 0.9.1 makes them."""
    from verl.experimental.agent_loop import agent_loop

    k, prompt_len, response_len = 3, 6, 8
    topk.install(k=k)
    worker = object.__new__(agent_loop.AgentLoopWorker)  # _postprocess reads this one attribute
    worker.reward_loop_worker_handles = None
    responses = [[5, 7, 11, 2], [9, 1, 4, 4, 8, 3, 6]]
    inputs = [
        _internal_output([1, 2, 3], r, prompt_len, response_len, k, seed) for seed, r in enumerate(responses)
    ]
    batch = agent_loop.AgentLoopWorker._postprocess(worker, inputs).batch

    ids, lps = batch[topk.TOPK_IDS_KEY], batch[topk.TOPK_LOGPROBS_KEY]
    assert ids.shape == lps.shape == (2, response_len, k + 1)
    for i, response in enumerate(responses):
        want = inputs[i].extra_fields
        torch.testing.assert_close(ids[i, : len(response)], torch.tensor(want[topk.TOPK_IDS_KEY]))
        torch.testing.assert_close(lps[i, : len(response)], torch.tensor(want[topk.TOPK_LOGPROBS_KEY]))
        assert torch.isneginf(lps[i, len(response) :]).all()  # padding past the response
        # the sampled token is in every generated position's TopK ∪ {k}
        assert ((ids[i] == batch["responses"][i, :, None]) & lps[i].isfinite()).any(-1)[: len(response)].all()


def test_agent_loop_patch_refuses_top_k_rows_that_do_not_line_up() -> None:
    from verl.experimental.agent_loop import agent_loop

    k = 3
    topk.install(k=k)
    worker = object.__new__(agent_loop.AgentLoopWorker)
    worker.reward_loop_worker_handles = None
    shifted = _internal_output([1, 2], [5, 7, 11, 2], 4, 6, k, seed=0)
    rows = shifted.extra_fields
    rows[topk.TOPK_IDS_KEY] = (
        rows[topk.TOPK_IDS_KEY][1:] + rows[topk.TOPK_IDS_KEY][:1]
    )  # a token builder's edit
    rows[topk.TOPK_LOGPROBS_KEY] = rows[topk.TOPK_LOGPROBS_KEY][1:] + rows[topk.TOPK_LOGPROBS_KEY][:1]
    with pytest.raises(RuntimeError, match="do not line up"):
        agent_loop.AgentLoopWorker._postprocess(worker, [shifted])
