"""vLLM-shaped rollout outputs -> the padded top-K tensors the actor reads."""

from __future__ import annotations

import copy
import math
import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("verl")

import torch

from pdmctl.backends.verl import actor_loss, patches, topk
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


def test_the_carry_holds_each_response_unpadded_with_ids_in_32_bits() -> None:
    """What travels with the batch is each response's own `[T_i, K]` (no padding to the
    longest, no slot K: `responses` and `rollout_log_probs` hold it), int32 ids and float32 log-probs."""
    a = topk.extract_topk([1, 2], [position({1: (-0.1, 1)}), position({2: (-0.2, 2), 5: (-0.05, 1)})], k=2)
    b = topk.extract_topk([3], [position({3: (-0.3, 1)})], k=2)
    responses = torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0]])
    mask = (responses > 0).long()
    rollout_lp = torch.tensor([[-0.1, -0.2, 0.0, 0.0], [-0.3, 0.0, 0.0, 0.0]])
    ids, lps = topk.carry_topk([a, b], responses, mask, rollout_lp, k=2)
    assert ids.dtype == lps.dtype == object and ids.shape == lps.shape == (2,)
    assert [x.shape for x in ids] == [x.shape for x in lps] == [(2, 2), (1, 2)]
    assert all(x.dtype == np.int32 for x in ids) and all(x.dtype == np.float32 for x in lps)
    assert ids[0].tolist() == [[1, 0], [5, 2]] and np.array_equal(lps[0], a.logprobs[:, :2].numpy())
    assert ids[1].tolist() == [[3, 0]] and np.array_equal(lps[1], b.logprobs[:, :2].numpy())
    # a response longer than the batch's response length is cut to it
    cut_ids, cut_lps = topk.carry_topk([a], responses[:1, :1], mask[:1, :1], rollout_lp[:1, :1], k=2)
    assert cut_ids[0].tolist() == [[1, 0]] and cut_lps[0].shape == (1, 2)
    with pytest.raises(ValueError, match="width 3 != K\\+1 = 4"):
        topk.carry_topk([a], responses[:1], mask[:1], rollout_lp[:1], k=3)


def test_slot_k_is_rebuilt_from_the_sampled_token_and_refused_where_that_would_change_it() -> None:
    """Slot K (the sampled token where it is outside the top-K) is VeRL's `responses` and
    `rollout_log_probs`; where the support's slot K is not exactly those, the carry refuses the batch."""
    out = topk.extract_topk([42, 1], [position({42: (-6.0, 17), 1: (-0.1, 1), 2: (-2.5, 2)}),
                                      position({1: (-0.2, 1), 2: (-1.0, 2)})], k=2)  # fmt: skip
    rebuilt = topk.sampled_slot(out.ids[:, :2], out.logprobs[:, :2], torch.tensor([42, 1]), torch.tensor([-6.0, -0.2]))
    assert torch.equal(rebuilt[0], out.ids[:, 2]) and torch.equal(rebuilt[1], out.logprobs[:, 2])
    responses, mask = torch.tensor([[42, 1]]), torch.ones(1, 2, dtype=torch.long)
    topk.carry_topk([out], responses, mask, torch.tensor([[-6.0, -0.2]]), k=2)
    off_by_one_ulp = torch.nextafter(torch.tensor(-6.0), torch.tensor(0.0))
    with pytest.raises(RuntimeError, match="response 0, position 0: the support's slot K"):
        topk.carry_topk([out], responses, mask, torch.tensor([[off_by_one_ulp, -0.2]]), k=2)
    with pytest.raises(ValueError, match="outside int32"):
        topk.int32_ids(torch.tensor([2**31]))


def test_the_server_hands_over_numpy_views_the_agent_loop_takes_without_a_copy() -> None:
    """The vLLM server puts the support in `extra_fields` as numpy arrays, ids in 32 bits (Ray sends
    their buffers as bytes); the agent loop's `_support_from_extra_fields` turns them back into the same
    tensors without a copy."""
    import pickle

    support = topk.extract_topk([1, 2], [position({1: (-0.1, 1)}), position({2: (-0.2, 1)})], k=2)
    extra = {topk.TOPK_IDS_KEY: topk.int32_ids(support.ids).numpy(), topk.TOPK_LOGPROBS_KEY: support.logprobs.numpy()}
    back = patches._support_from_extra_fields(pickle.loads(pickle.dumps(extra, protocol=5)))
    assert torch.equal(back.ids.long(), support.ids) and torch.equal(back.logprobs, support.logprobs)
    assert back.ids.dtype == torch.int32 and back.logprobs.dtype == torch.float32
    shared = patches._support_from_extra_fields(extra)
    assert shared.ids.data_ptr() == extra[topk.TOPK_IDS_KEY].ctypes.data  # no copy on the agent loop's side


def test_version_pin() -> None:
    topk.check_verl_version()  # the installed, pinned verl
    with pytest.raises(topk.VerlVersionError, match=r"verl==0\.9\.1"):
        topk.check_verl_version("0.10.0")


def test_install_patches_actor_and_agent_loop_idempotently() -> None:
    from verl.experimental.agent_loop import agent_loop
    from verl.workers import engine_workers

    patches.install(k=4)
    patched = engine_workers.TrainingWorker.train_batch
    patches.install(k=4)
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
    sampled_lp = [positions[t][token].logprob for t, token in enumerate(response)]  # VeRL's own read
    prompt_ids = torch.tensor([[0] * (prompt_len - len(prompt)) + prompt])
    response_ids = torch.tensor([response + [0] * (response_len - len(response))])
    prompt_mask = (torch.arange(prompt_len) >= prompt_len - len(prompt)).long()[None]
    response_mask = (torch.arange(response_len) < len(response)).long()[None]
    attention = torch.cat([prompt_mask, response_mask], 1)
    return _InternalAgentLoopOutput(
        prompt_ids=prompt_ids, response_ids=response_ids, input_ids=torch.cat([prompt_ids, response_ids], 1),
        position_ids=(attention.cumsum(-1) - 1).clamp_min(0), response_mask=response_mask, attention_mask=attention,
        response_logprobs=torch.tensor([sampled_lp + [0.0] * (response_len - len(response))]), num_turns=2,
        metrics=AgentLoopMetrics(),
        extra_fields={topk.TOPK_IDS_KEY: support.ids.tolist(), topk.TOPK_LOGPROBS_KEY: support.logprobs.tolist(),
                      "turn_scores": [], "tool_rewards": []},
    )  # fmt: skip


def test_agent_loop_patch_puts_each_responses_top_k_in_the_batch_and_the_actor_reads_it_back() -> None:
    """VeRL's own `AgentLoopWorker._postprocess`, patched, on outputs shaped as VeRL 0.9.1 makes them: each
    response's `[T_i, K]` in non_tensor_batch. Through the DataProto's own concat and reorder (the
    trainer's balance_batch), `to_tensordict` and `left_right_2_no_padding`, the actor's read gives back
    every generated token's `TopK ∪ {k}` as vLLM returned it."""
    from verl import DataProto
    from verl.experimental.agent_loop import agent_loop
    from verl.workers.utils.padding import left_right_2_no_padding

    k, prompt_len, response_len = 3, 6, 8
    patches.install(k=k)
    worker = object.__new__(agent_loop.AgentLoopWorker)  # _postprocess reads this one attribute
    worker.reward_loop_worker_handles = None
    responses = [[5, 7, 11, 2], [9, 1, 4, 4, 8, 3, 6], [3, 3, 3, 3, 3, 3, 3, 3]]
    inputs = [
        _internal_output([1, 2, 3], r, prompt_len, response_len, k, seed) for seed, r in enumerate(responses)
    ]
    outputs = [agent_loop.AgentLoopWorker._postprocess(worker, inputs[:2]),
               agent_loop.AgentLoopWorker._postprocess(worker, inputs[2:])]  # fmt: skip
    ids, lps = outputs[0].non_tensor_batch[topk.TOPK_IDS_KEY], outputs[0].non_tensor_batch[topk.TOPK_LOGPROBS_KEY]
    assert topk.TOPK_IDS_KEY not in outputs[0].batch.keys()  # noqa: SIM118
    for i, response in enumerate(responses[:2]):
        want = inputs[i].extra_fields
        assert ids[i].dtype == np.int32 and ids[i].shape == lps[i].shape == (len(response), k)
        assert np.array_equal(ids[i], np.asarray(want[topk.TOPK_IDS_KEY])[:, :k])
        assert np.array_equal(lps[i], np.asarray(want[topk.TOPK_LOGPROBS_KEY], dtype=np.float32)[:, :k])

    proto = DataProto.concat(outputs)
    proto.reorder(torch.tensor([2, 0, 1]))
    proto.batch["advantages"] = torch.zeros(3, response_len)  # the trainer adds them before the actor
    data = left_right_2_no_padding(proto.to_tensordict())
    total = int(data["input_ids"].offsets()[-1])
    _, tokens = actor_loss.response_tokens(data, total, torch.device("cpu"))
    order = [2, 0, 1]
    want_ids = torch.cat([torch.tensor(inputs[i].extra_fields[topk.TOPK_IDS_KEY]) for i in order])
    want_lps = torch.cat([torch.tensor(inputs[i].extra_fields[topk.TOPK_LOGPROBS_KEY]) for i in order])
    assert torch.equal(tokens.topk_ids, want_ids) and torch.equal(tokens.topk_logprobs, want_lps)
    assert torch.equal(tokens.sampled_ids, torch.tensor([t for i in order for t in responses[i]]))


def test_the_agent_loop_takes_top_k_carried_as_tensors() -> None:
    """The vLLM server patch puts the extraction's tensors in `extra_fields` (not lists): VeRL's own
    pydantic outputs keep them through Ray's pickling, and the batch carries the same."""
    import pickle

    from verl.experimental.agent_loop import agent_loop
    from verl.workers.rollout.replica import TokenOutput

    k = 3
    patches.install(k=k)
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
    want = agent_loop.AgentLoopWorker._postprocess(worker, [as_lists]).non_tensor_batch
    got = agent_loop.AgentLoopWorker._postprocess(worker, [as_tensors]).non_tensor_batch
    for key in (topk.TOPK_IDS_KEY, topk.TOPK_LOGPROBS_KEY):
        assert got[key][0].dtype == want[key][0].dtype and np.array_equal(got[key][0], want[key][0])


def test_the_v1_trainers_per_sample_fields_carry_the_same_layout() -> None:
    """V1 (TransferQueue): the patched `list_of_dict_to_tensordict` turns each sample's top-K into its
    `[T, K]` int32 / float32 fields; the actor reads the nested fields back as vLLM returned them."""
    from verl.utils import tensordict_utils

    k = 3
    patches.install(k=k)
    fields, want = [], []
    for seed, response in enumerate([[5, 7, 11, 2], [9, 1, 4]]):
        out = _internal_output([1, 2], response, 2, len(response), k, seed)
        fields.append({"responses": out.response_ids[0], "response_mask": out.response_mask[0],
                       "rollout_log_probs": out.response_logprobs[0], "extra_fields": dict(out.extra_fields)})  # fmt: skip
        want.append(torch.tensor(out.extra_fields[topk.TOPK_IDS_KEY]))
    td = tensordict_utils.list_of_dict_to_tensordict(fields)
    ids = td[topk.TOPK_IDS_KEY]
    assert ids.is_nested and ids.dtype == torch.int32 and td[topk.TOPK_LOGPROBS_KEY].dtype == torch.float32
    assert [t.shape for t in ids.unbind()] == [(4, k), (3, k)]
    valid = torch.tensor([[True] * 4, [True] * 3 + [False]])
    top, carried = topk.carried_rows(ids, valid)
    assert bool(carried.all()) and torch.equal(top.long(), torch.cat(want)[:, :k])


def test_the_v1_actor_reads_each_micro_batchs_top_k_as_vllm_returned_it() -> None:
    """V1 end to end without the engine: each rollout stored as V1's agent loop stores it (one
    `list_of_dict_to_tensordict` per output), read back per field as TransferQueue packs samples (a jagged
    nested tensor), cut into a shuffled mini-batch (`make_iterator`'s `index_select_tensor_dict`) and micro-
    batches (`chunk_tensordict`), then read by the actor's `response_tokens`: every generated token's
    `TopK ∪ {k}`, slot K rebuilt, equals vLLM's support. (The V1 engine test once masked
    nothing with the carry; in the real engine this read equalled the padded layout's at all 24 micro-batches.)"""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    k = 3
    patches.install(k=k)
    lengths = [4, 2, 5, 1, 3, 5]
    stored, supports, responses = [], [], []
    for seed, n in enumerate(lengths):
        response = [(seed * 5 + j) % 11 + 1 for j in range(n)]
        out = _internal_output([1, 2], response, 2, n, k, seed)
        prompts = out.prompt_ids[0]
        fields = {"prompts": prompts, "responses": out.response_ids[0], "response_mask": out.response_mask[0],
                  "rollout_log_probs": out.response_logprobs[0].float(), "input_ids": torch.cat([prompts, out.response_ids[0]]),
                  "extra_fields": dict(out.extra_fields)}  # fmt: skip
        stored.append(tu.list_of_dict_to_tensordict([fields]))  # V1's agent loop: one put per output
        supports.append(out.extra_fields)
        responses.append(response)
    batch = TensorDict(
        {key: torch.nested.as_nested_tensor([td[key][0] for td in stored], layout=torch.jagged)
         for key in ("prompts", "responses", "response_mask", "rollout_log_probs", "input_ids",
                     topk.TOPK_IDS_KEY, topk.TOPK_LOGPROBS_KEY)},
        batch_size=[len(lengths)],
    )  # fmt: skip
    assert batch[topk.TOPK_IDS_KEY].dtype == torch.int32
    order = [3, 5, 0, 4]  # a shuffled mini-batch, then two micro-batches of two
    for i, micro in enumerate(tu.chunk_tensordict(tu.index_select_tensor_dict(batch, torch.tensor(order)), 2)):
        samples = order[2 * i : 2 * i + 2]
        micro["advantages"] = torch.nested.as_nested_tensor([torch.zeros(lengths[s]) for s in samples], layout=torch.jagged)
        _, tokens = actor_loss.response_tokens(micro, int(micro["input_ids"].offsets()[-1]), torch.device("cpu"))
        want_ids = torch.cat([torch.tensor(supports[s][topk.TOPK_IDS_KEY]) for s in samples])
        want_lps = torch.cat([torch.tensor(supports[s][topk.TOPK_LOGPROBS_KEY]) for s in samples])
        assert torch.equal(tokens.topk_ids, want_ids) and torch.equal(tokens.topk_logprobs, want_lps)
        assert tokens.sampled_ids.tolist() == [t for s in samples for t in responses[s]]


def test_agent_loop_patch_refuses_top_k_rows_that_do_not_line_up() -> None:
    from verl.experimental.agent_loop import agent_loop

    k = 3
    patches.install(k=k)
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

    monkeypatch.setattr(patches, "_ANNOUNCED", set())
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for _ in range(3):
        patches.announce(f"actor {patches._actor_rank()} trained a batch")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"pdmctl: actor rank 1 of 2 trained a batch on {socket.gethostname()} (pid {os.getpid()})"]


def test_the_actor_reads_the_carried_rows_of_any_mask_in_the_padded_layouts_order() -> None:
    """`carried_rows` gives `padded[valid]`'s rows in its order for a mask with holes (tool tokens) and
    positions no response holds (then `carried` is False there), from each form a micro-batch holds."""
    a = np.arange(3 * 2, dtype=np.int32).reshape(3, 2)
    b = np.arange(100, 100 + 2 * 2, dtype=np.int32).reshape(2, 2)
    valid = torch.tensor([[True, False, True, True], [True, True, True, False]])
    padded = torch.zeros(2, 4, 2, dtype=torch.int32)
    padded[0, :3], padded[1, :2] = torch.from_numpy(a), torch.from_numpy(b)
    nested = torch.nested.nested_tensor_from_jagged(torch.from_numpy(np.concatenate([a, b])), torch.tensor([0, 3, 5]))
    for form in ([a, b], nested):
        rows, carried = topk.carried_rows(form, valid)
        assert carried.tolist() == [True, True, False, True, True, False]
        assert torch.equal(rows[carried], padded[valid][carried]), type(form)
    rows, carried = topk.carried_rows(padded, valid)  # one [bsz, T, K] tensor: every position held
    assert bool(carried.all()) and torch.equal(rows, padded[valid])
