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
