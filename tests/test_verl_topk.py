"""vLLM-shaped rollout outputs -> the padded top-K tensors the actor reads."""

from __future__ import annotations

import copy
import math
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("verl")

import torch

from pdmctl.backends.verl import topk
from tests.topk_reference import Logprob, flatten, reference_extract_topk, vllm_flat_response, vllm_response

pytestmark = pytest.mark.verl


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


def _same_as_reference(token_ids, positions, k: int) -> None:
    """The vectorised extraction gives the per-token loop's tensors, or raises its error."""
    try:
        want = reference_extract_topk(token_ids, positions, k)
    except ValueError as exc:
        for given in (positions, flatten(positions)):
            with pytest.raises(ValueError) as info:
                topk.extract_topk(token_ids, given, k)
            assert str(info.value) == str(exc)
        return
    # vLLM's dicts, and the same positions as vLLM's FlatLogprobs (back to back, and with gaps)
    for given in (positions, flatten(positions), flatten(positions, gap=2)):
        got = topk.extract_topk(token_ids, given, k)
        assert got.ids.dtype == want.ids.dtype and got.logprobs.dtype == want.logprobs.dtype
        assert torch.equal(got.ids, want.ids), type(given)
        assert torch.equal(got.logprobs, want.logprobs), type(given)


@pytest.mark.parametrize(("k", "length", "seed"), [(1, 50, 0), (3, 200, 1), (20, 500, 2), (50, 64, 3), (20, 0, 4)])
def test_vectorised_extraction_matches_the_per_token_loop_on_vllm_shaped_output(k, length, seed) -> None:
    token_ids, positions = vllm_response(random.Random(seed), length, k, vocab=1000, p_outside=0.3)
    _same_as_reference(token_ids, positions, k)


@pytest.mark.parametrize(("k", "length", "seed"), [(1, 50, 0), (3, 200, 1), (20, 500, 2), (50, 64, 3), (20, 0, 4)])
def test_vllms_flat_layout_is_read_as_arrays_and_gives_what_its_dicts_give(k, length, seed) -> None:
    """vLLM's FlatLogprobs (K+1 entries per position, the sampled token first and again in the top-K
    where it is there): the reshape path, the same tensors as the per-token loop on the dicts it
    stands for; and where one position breaks the layout, the dict path, still the same."""
    token_ids, flat = vllm_flat_response(random.Random(seed), length, k, vocab=1000, p_outside=0.3)
    assert topk._topk_from_vllm_flat(token_ids, flat, k) is not None  # the fast path takes it
    as_dicts = [flat[t] for t in range(len(flat))]
    _same_as_reference(token_ids, as_dicts, k)
    want = reference_extract_topk(token_ids, as_dicts, k)
    got = topk.extract_topk(token_ids, flat, k)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.logprobs, want.logprobs)
    width = k + 1
    outside = [t for t in range(length) if flat.ranks[t * width] > k]
    inside = [t for t in range(length) if flat.ranks[t * width] <= k]
    cases = []  # (what breaks the layout, flat index, new rank)
    if outside:  # a sampled token ranked within K that the top-K does not list
        cases.append(("ranked 1, not listed", outside[0] * width, 1))
    if inside:  # one the top-K lists, ranked beyond K
        cases.append(("listed, ranked beyond K", inside[0] * width, k + 3))
    if length:  # a top-K entry without a rank
        cases.append(("unranked top-K entry", 1, None))
    for what, index, rank in cases:
        broken = copy.deepcopy(flat)
        broken.ranks[index] = rank
        assert topk._topk_from_vllm_flat(token_ids, broken, k) is None, what
        _same_as_reference(token_ids, [broken[t] for t in range(len(broken))], k)
        want = reference_extract_topk(token_ids, [broken[t] for t in range(len(broken))], k)
        got = topk.extract_topk(token_ids, broken, k)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.logprobs, want.logprobs), what


_entry = st.tuples(
    st.sampled_from([0.0, -0.5, -1.0, -1.0, -2.5, -math.inf]),  # repeats: ties on log-prob
    st.one_of(st.none(), st.integers(-1, 8)),  # missing, repeated, beyond K, below 1 (vLLM's start at 1)
)
_position = st.dictionaries(st.integers(0, 9), _entry, max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), _position), max_size=12), st.integers(1, 6))
def test_vectorised_extraction_matches_the_per_token_loop_on_any_input(rows, k) -> None:
    """Ties in rank and log-prob, unranked entries, more or fewer entries than K, a sampled token
    missing from its position: the same tensors (dict order breaking ties) or the same error."""
    token_ids = [sampled for sampled, _ in rows]
    positions = [{tid: Logprob(lp, rank) for tid, (lp, rank) in entries.items()} for _, entries in rows]
    _same_as_reference(token_ids, positions, k)


def test_mismatched_lengths_and_bad_k_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        topk.extract_topk([1, 2], [position({1: (-0.1, 1)})], k=1)
    with pytest.raises(ValueError, match="k: must be >= 1"):
        topk.extract_topk([1], [position({1: (-0.1, 1)})], k=0)


def test_pad_to_response_length() -> None:
    a = topk.extract_topk([1, 2], [position({1: (-0.1, 1)}), position({2: (-0.2, 1)})], k=2)
    b = topk.extract_topk([3], [position({3: (-0.3, 1)})], k=2)
    padded = topk.pad_topk([a, b], response_length=4, k=2)
    assert padded.ids.shape == padded.logprobs.shape == (2, 4, 3)
    assert padded.ids[1, 0, 0] == 3 and torch.isinf(padded.logprobs[1, 1:]).all()
    assert padded.logprobs.dtype == torch.float32 and padded.ids.dtype == torch.int64
    # the padding is written, not left as the empty tensor's bytes: id 0 and -inf after each response
    assert (padded.ids[0, 2:] == 0).all() and (padded.ids[1, 1:] == 0).all()
    assert (padded.logprobs[0, 2:] == -math.inf).all() and (padded.logprobs[1, 1:] == -math.inf).all()
    torch.testing.assert_close(padded.logprobs[0, :2], a.logprobs)
    assert torch.equal(padded.ids[0, :2], a.ids)
    # a response longer than the batch's response length is cut to it
    cut = topk.pad_topk([a], response_length=1, k=2)
    assert torch.equal(cut.ids[0], a.ids[:1]) and torch.equal(cut.logprobs[0], a.logprobs[:1])


def test_the_server_hands_over_numpy_views_the_agent_loop_takes_without_a_copy() -> None:
    """The vLLM server puts the support in `extra_fields` as numpy arrays (Ray sends their buffers as
    bytes); the agent loop's `_support_from_extra_fields` turns them back into the same tensors."""
    import pickle

    support = topk.extract_topk([1, 2], [position({1: (-0.1, 1)}), position({2: (-0.2, 1)})], k=2)
    extra = {topk.TOPK_IDS_KEY: support.ids.numpy(), topk.TOPK_LOGPROBS_KEY: support.logprobs.numpy()}
    back = topk._support_from_extra_fields(pickle.loads(pickle.dumps(extra, protocol=5)))
    assert torch.equal(back.ids, support.ids) and torch.equal(back.logprobs, support.logprobs)
    assert back.ids.dtype == torch.int64 and back.logprobs.dtype == torch.float32
    shared = topk._support_from_extra_fields(extra)
    assert shared.ids.data_ptr() == support.ids.data_ptr()  # no copy on the agent loop's side


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


def test_the_agent_loop_takes_top_k_carried_as_tensors() -> None:
    """The vLLM server patch puts the extraction's tensors in `extra_fields` (not lists): VeRL's own
    pydantic outputs keep them through Ray's pickling, and the padded batch is the same."""
    import pickle

    from verl.experimental.agent_loop import agent_loop
    from verl.workers.rollout.replica import TokenOutput

    k = 3
    topk.install(k=k)
    worker = object.__new__(agent_loop.AgentLoopWorker)
    worker.reward_loop_worker_handles = None
    as_lists = _internal_output([1, 2], [5, 7, 11, 2], 4, 6, k, seed=0)
    fields = as_lists.extra_fields
    carried = {topk.TOPK_IDS_KEY: torch.tensor(fields[topk.TOPK_IDS_KEY]),
               topk.TOPK_LOGPROBS_KEY: torch.tensor(fields[topk.TOPK_LOGPROBS_KEY])}  # fmt: skip
    server_output = pickle.loads(pickle.dumps(TokenOutput(token_ids=[5, 7, 11, 2], extra_fields=carried)))
    as_tensors = _internal_output([1, 2], [5, 7, 11, 2], 4, 6, k, seed=0)
    as_tensors.extra_fields.update(server_output.extra_fields)
    assert isinstance(as_tensors.extra_fields[topk.TOPK_IDS_KEY], torch.Tensor)
    want = agent_loop.AgentLoopWorker._postprocess(worker, [as_lists]).batch
    got = agent_loop.AgentLoopWorker._postprocess(worker, [as_tensors]).batch
    for key in (topk.TOPK_IDS_KEY, topk.TOPK_LOGPROBS_KEY):
        assert torch.equal(got[key], want[key])


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


def test_announce_says_where_once_per_process(capsys, monkeypatch) -> None:
    """The placement lines tests/test_verl_multinode.py reads: host and pid, each role once."""
    import socket

    monkeypatch.setattr(topk, "_ANNOUNCED", set())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for _ in range(3):
        topk.announce(f"actor {topk._actor_rank()} trained a batch")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"pdmctl: actor rank 1 of 2 trained a batch on {socket.gethostname()} (pid {os.getpid()})"]
