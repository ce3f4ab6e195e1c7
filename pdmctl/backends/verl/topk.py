"""Rollout top-K log-probs through VeRL 0.9.1: the rollout side, and the names the three modules share.

VeRL 0.9.1 keeps only the sampled token's rollout log-prob. The top-K masks need,
per generated token, the rollout's `TopK(μ) ∪ {k}` (ids and log-probs) and the
training logits over the whole vocabulary. Three modules know how VeRL 0.9.1 is
built inside; they refuse any other version (`check_verl_version`), because every
function they wrap is private API. From pure to invasive:

1. this module: `extract_topk` / `carry_topk` / `carried_rows`: vLLM's per-position
   logprobs (vLLM's flat lists, or dicts of values with `rank` and `logprob`) ->
   fixed-width `[T, K+1]` ids and log-probs, and the batch's layout of them: per
   response, unpadded, `[T_i, K]` int32 ids and float32 log-probs (slot K rebuilt on
   the actor, `sampled_slot`). Pure; tested on CPU with vLLM-shaped objects.
2. `actor_loss.pdm_ppo_loss`: the actor's loss function, used twice per micro-batch
   the way VeRL's own top-K distillation loss is: as the engine's logits processor it
   runs `pdmctl.masks.token_diagnostics` on the full logits; with `model_output` it
   hands those diagnostics to VeRL's unmodified `ppo_loss`. Tested on CPU through
   VeRL's own `ppo_loss` and `logprobs_from_logits`.
3. `patches.install`: monkeypatches of VeRL's vLLM server, its agent loops (V0 and
   V1's TransferQueue) and the actor worker. Exercised by the engine tests (VeRL +
   vLLM's CPU build).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from operator import attrgetter, methodcaller
from typing import Any, Protocol

import numpy as np
import torch

from pdmctl import masks

SUPPORTED_VERL_VERSION = "0.9.1"
CARRY_ID_MAX = 2**31 - 1  # the carry holds token ids as int32 (carry_topk)
TOPK_ENV = "PDMCTL_VERL_TOPK"  # K for the rollout; set by the job body, read by every Ray worker

# Batch keys the carry adds (per response, [T_i, K]); model_output keys the actor's logits processor adds
# ([bsz, seq] nested, actor_loss.py).
TOPK_IDS_KEY = "rollout_topk_ids"
TOPK_LOGPROBS_KEY = "rollout_topk_logprobs"
FLAT_LOGPROBS_LINE = "SamplingParams.flat_logprobs"  # a vLLM server's line once it reads the flat lists
DIAGNOSTIC_KEYS = ("keep", "divergence", "ddot", "ratio", "log_ratio", "out_of_region", "disagree")
_OUTPUT_PREFIX = "pdmctl_"
LOSS_PREFIX = "pdmctl_"  # VeRL loss modes `pdmctl_<method>`, registered by plugin.py
DUMP_ENV = "PDMCTL_VERL_DUMP_DIR"  # debug: each actor process saves its first micro-batch here
FAIL_ENV = "PDMCTL_VERL_FAIL"  # test: "rollout" raises in the vLLM server's generate (failure injection)
PROFILE_ENV = "PDMCTL_VERL_PROFILE_DIR"  # bench: each actor process logs the time its mask takes here


def loss_name(method: str) -> str:
    return f"{LOSS_PREFIX}{method}"


def is_pdmctl_loss(name: str) -> bool:
    return name.startswith(LOSS_PREFIX)


def method_of_loss(name: str) -> str:
    if not is_pdmctl_loss(name) or name[len(LOSS_PREFIX) :] not in masks.METHODS:
        known = sorted(loss_name(method) for method in masks.METHODS)
        raise ValueError(f"{name!r} is not a pdmctl loss; registered: {known}")
    return name[len(LOSS_PREFIX) :]


class VerlVersionError(RuntimeError):
    """The installed verl is not the version this patch was written against."""


def check_verl_version(installed: str | None = None) -> None:
    """Raise unless verl == SUPPORTED_VERL_VERSION (every patched function is private API)."""
    if installed is None:
        import verl

        installed = verl.__version__
    if installed != SUPPORTED_VERL_VERSION:
        raise VerlVersionError(
            f"pdmctl's VeRL top-K patch is written for verl=={SUPPORTED_VERL_VERSION}, found verl=={installed}; "
            f"install the pinned version (pip install 'pdmctl[verl]') or port pdmctl/backends/verl/topk.py, actor_loss.py and patches.py"
        )


# ---------------------------------------------------------------------------
# 1. vLLM output -> the supports, and the layout the batch carries them in
# ---------------------------------------------------------------------------


class VllmLogprob(Protocol):
    """The fields of `vllm.sequence.Logprob` this module reads."""

    logprob: float
    rank: int | None


@dataclass(frozen=True)
class RolloutTopK:
    """One response's support per generated token: `[T, K+1]` ids (int64) and log-probs (float32).

    Slots 0..K-1 hold the rollout's top-K by rank (-inf log-prob, id 0 where vLLM
    returned fewer); slot K holds the sampled token when it is not among them
    (MATH.md's `S = TopK(μ, K) ∪ {k}`), else -inf padding.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor


def _is_flat(logprobs: Any) -> bool:
    """vLLM's `FlatLogprobs` (`SamplingParams(flat_logprobs=True)`, which the server patch asks for)."""
    return all(hasattr(logprobs, f) for f in ("start_indices", "end_indices", "token_ids", "logprobs", "ranks"))


def _topk_from_vllm_flat(token_ids: Sequence[int], flat: Any, k: int) -> RolloutTopK | None:
    """vLLM's flat layout read as arrays, without a Logprob object per entry. vLLM 0.24 appends per
    position exactly K+1 entries: the sampled token with its rank, then the top-K by rank 1..K (the
    sampled token again where it is among them: `vllm.logprobs.append_logprobs_for_next_position`).
    Where the lists are so, the support is a reshape; None where they are not (then the caller reads
    them as the dicts they stand for).

    Only the ids and the log-probs are turned into arrays (one `np.fromiter` each: the cost floor,
    one Python object read per entry); the layout is checked with list operations that run in C
    (slices, repetition, equality: the ranks 1..K are small ints, compared by identity), so the
    ranks list is never converted, and the `{token_id: Logprob}` dicts are never built."""
    n, width = len(token_ids), k + 1
    total = n * width
    lists = [f if isinstance(f, list) else list(f) for f in (flat.start_indices, flat.end_indices, flat.ranks)]
    starts, ends, ranks = lists
    if len(starts) != n or len(ends) != n or len(ranks) != total:
        return None
    if len(flat.token_ids) != total or len(flat.logprobs) != total:
        return None
    if starts != list(range(0, total, width)) or ends != list(range(width, total + width, width)):
        return None
    sampled_rank = ranks[0::width]  # the sampled token's rank at each position (None: vLLM gave none)
    expected = list(range(width)) * n
    expected[0::width] = sampled_rank
    if ranks != expected:  # every position lists the top-K by rank 1..K after the sampled token
        return None
    ids_list = flat.token_ids if isinstance(flat.token_ids, list) else list(flat.token_ids)
    sampled_list = token_ids if isinstance(token_ids, list) else list(token_ids)
    if ids_list[0::width] != sampled_list:
        return None
    ids = np.fromiter(ids_list, dtype=np.int64, count=total).reshape(n, width)
    sampled = ids[:, 0]
    inside = np.array(sampled_rank, dtype=np.float64) <= k  # nan (no rank) compares False: outside
    if not np.array_equal((ids[:, 1:] == sampled[:, None]).any(1), inside):
        return None  # a sampled token ranked within K but not listed there (or the reverse): as dicts
    logprobs = np.fromiter(flat.logprobs, dtype=np.float32, count=total).reshape(n, width)
    out_ids = np.empty((n, width), dtype=np.int64)
    out_lp = np.empty((n, width), dtype=np.float32)
    out_ids[:, :k], out_lp[:, :k] = ids[:, 1:], logprobs[:, 1:]
    out_ids[:, k] = np.where(inside, 0, sampled)
    out_lp[:, k] = np.where(inside, -np.inf, logprobs[:, 0])
    return RolloutTopK(torch.from_numpy(out_ids), torch.from_numpy(out_lp))


def extract_topk(
    token_ids: Sequence[int], position_logprobs: Sequence[Mapping[int, VllmLogprob]], k: int
) -> RolloutTopK:
    """vLLM's `CompletionOutput.logprobs` (one {token_id: Logprob} per generated token) -> `RolloutTopK`.

    vLLM returns the top-`logprobs` entries by rank plus the sampled token (rank > K
    when it was not among them); dict order is not rank order, so entries are sorted
    by `rank` (ties and missing ranks fall back to the log-prob, then to dict order).

    Vectorised: every entry of every position is read out in one pass of C-level
    iterators (`chain`, `map`, `attrgetter` into `np.fromiter`: no Python bytecode per
    token or entry), then ranked, cut to K and placed with array operations. The per-token
    loop it replaces ran at ~8k tokens/s, which at 8,192 tokens x K = 20 per response was
    about as fast as a GPU generates them (bench/topk.py).
    """
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    n = len(token_ids)
    if n != len(position_logprobs):
        raise ValueError(f"token_ids ({n}) and logprobs ({len(position_logprobs)}) differ in length")
    if _is_flat(position_logprobs):  # vLLM's FlatLogprobs
        fast = _topk_from_vllm_flat(token_ids, position_logprobs, k)
        if fast is not None:
            return fast
        position_logprobs = [position_logprobs[t] for t in range(n)]  # the dict each position stands for
    counts = np.fromiter(map(len, position_logprobs), dtype=np.int64, count=n)
    total = int(counts.sum())
    entry_ids = np.fromiter(chain.from_iterable(position_logprobs), dtype=np.int64, count=total)
    values = list(chain.from_iterable(map(methodcaller("values"), position_logprobs)))
    entry_lp = np.fromiter(map(_LOGPROB, values), dtype=np.float64, count=total)
    entry_rank = np.fromiter(map(_RANK, values), dtype=np.float64, count=total)  # None -> nan
    position = np.repeat(np.arange(n), counts)
    # Rank order within each position. Entries ranked beyond K never enter the top-K and unranked
    # ones come after every ranked one, so ranks clamp to K+1 (beyond) and K+2 (unranked): one exact
    # integer key, its ties left in dict order by a stable sort.
    eligible = np.isnan(entry_rank) | (entry_rank <= k)
    rank_key = np.where(np.isnan(entry_rank), k + 2, np.minimum(np.nan_to_num(entry_rank), k + 1))
    key = position * (k + 3) + rank_key.astype(np.int64)
    order = np.argsort(key, kind="stable")
    tied = (np.diff(key[order]) == 0) & eligible[order][1:]
    if tied.any() or (entry_rank < 1).any():  # equal ranks, unranked entries, ranks vLLM never gives:
        # (rank, -log-prob) as sorted() compared them, dict order breaking what ties remain
        order = np.lexsort((-entry_lp, np.where(np.isnan(entry_rank), np.inf, entry_rank), position))
    position, entry_ids, entry_lp, eligible = position[order], entry_ids[order], entry_lp[order], eligible[order]
    # the first K eligible entries of each position fill its slots 0..K-1
    eligible_before = np.cumsum(eligible) - eligible
    per_position = np.bincount(position[eligible], minlength=n)
    slot = eligible_before - (np.cumsum(per_position) - per_position)[position]
    top = eligible & (slot < k)
    ids = np.zeros((n, k + 1), dtype=np.int64)
    logprobs = np.full((n, k + 1), -np.inf, dtype=np.float32)
    ids[position[top], slot[top]] = entry_ids[top]
    logprobs[position[top], slot[top]] = entry_lp[top]
    # slot K: the sampled token where it is not among the top-K (a dict holds a token once)
    sampled = np.fromiter(token_ids, dtype=np.int64, count=n)
    is_sampled = entry_ids == sampled[position]
    in_top = np.zeros(n, dtype=bool)
    in_top[position[is_sampled & top]] = True
    has_sampled = np.zeros(n, dtype=bool)
    has_sampled[position[is_sampled]] = True
    missing = ~in_top & ~has_sampled
    if missing.any():
        t = int(np.flatnonzero(missing)[0])
        raise ValueError(f"position {t}: vLLM returned no log-prob for the sampled token {int(sampled[t])}")
    outside = is_sampled & ~in_top[position]
    ids[position[outside], k] = entry_ids[outside]
    logprobs[position[outside], k] = entry_lp[outside]
    return RolloutTopK(torch.from_numpy(ids), torch.from_numpy(logprobs))


_LOGPROB = attrgetter("logprob")
_RANK = attrgetter("rank")


def int32_ids(ids: torch.Tensor) -> torch.Tensor:
    """Token ids as int32, what the carry moves (a vocabulary of 151,936 needs 18 bits); refuses ids
    int32 cannot hold rather than wrapping them."""
    if ids.dtype == torch.int32:
        return ids
    if ids.numel() and (int(ids.max()) > CARRY_ID_MAX or int(ids.min()) < -CARRY_ID_MAX - 1):
        raise ValueError(f"top-K ids outside int32 (max {int(ids.max())}): the carry holds ids in 32 bits")
    return ids.to(torch.int32)


def sampled_slot(
    top_ids: torch.Tensor, top_logprobs: torch.Tensor, sampled_ids: torch.Tensor, sampled_logprobs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot K of `TopK ∪ {k}` from the top-K slots (`[n, K]`) and the sampled token (`[n]`): the sampled
    token and its rollout log-prob where it is not among the top-K (a slot holding it with a finite
    log-prob), else id 0 and -inf (`extract_topk`'s padding)."""
    inside = ((top_ids == sampled_ids[:, None]) & torch.isfinite(top_logprobs)).any(-1)
    ids = torch.where(inside, torch.zeros_like(sampled_ids), sampled_ids)
    logprobs = torch.where(inside, torch.full_like(sampled_logprobs, -math.inf), sampled_logprobs)
    return ids, logprobs


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)  # float32 compared bit for bit (-0.0 != 0.0, NaN == NaN)


def carry_topk(
    supports: Sequence[RolloutTopK],
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The rollout's supports as they travel with the batch: two object arrays `[bsz]` holding each
    response's own `[T_i, K]` int32 ids and float32 log-probs (T_i its length, cut to the batch's
    `response_length`), so nothing is padded to the longest response and nothing is stored twice.

    A `DataProto` keeps them in `non_tensor_batch` (every one of its operations indexes the object
    array; `to_tensordict` hands them to the workers as a `NonTensorStack`, whose arrays Ray sends as
    buffers). Slot K is not carried: it is the sampled token and its log-prob where the token is outside
    the top-K, and VeRL already carries both (`responses`, `rollout_log_probs`: its own read of the same
    vLLM log-prob). The actor rebuilds it (`sampled_slot`); here, where the full support is still at
    hand, that the rebuilt slot is the carried one, bit for bit, at every generated token is checked,
    and so is that the rows line up with the tokens (every generated token in its row's `TopK ∪ {k}`:
    a multi-turn agent loop or a token builder that edits the ids would shift them, silently).
    """
    bsz, width = responses.shape
    if len(supports) != bsz:
        raise ValueError(f"{len(supports)} top-K supports for a batch of {bsz} responses")
    for i, support in enumerate(supports):
        if support.ids.shape[-1] != k + 1:
            raise ValueError(f"response {i}: width {support.ids.shape[-1]} != K+1 = {k + 1}")
    lengths = torch.tensor([min(support.ids.shape[0], width) for support in supports], dtype=torch.long)
    # the batch's rows, response after response, in one array each: the checks run once per batch, and
    # each response's carried arrays are row slices of them (contiguous: Ray sends each as one buffer)
    top_ids = int32_ids(_rows(supports, "ids", lengths, slice(0, k)))
    top_logprobs = _rows(supports, "logprobs", lengths, slice(0, k)).float()
    slot_ids = _rows(supports, "ids", lengths, k).long()
    slot_logprobs = _rows(supports, "logprobs", lengths, k).float()
    held = torch.arange(width)[None, :] < lengths[:, None]  # [bsz, width]: the positions the supports hold
    tokens, generated = responses[held].long(), response_mask.bool()
    in_top = ((top_ids == tokens[:, None]) & torch.isfinite(top_logprobs)).any(-1)
    found = in_top | ((slot_ids == tokens) & torch.isfinite(slot_logprobs))
    missing = generated.clone()  # a generated position no support holds is missing
    missing[held] &= ~found
    if bool(missing.any()):
        sample, position = (int(i) for i in torch.nonzero(missing)[0])
        raise RuntimeError(
            f"pdmctl: the rollout top-K rows do not line up with the response tokens ({int(missing.sum())} "
            f"generated tokens are not in their row's TopK ∪ {{k}}; first: sample {sample}, position {position}). "
            "pdmctl carries top-K for single-turn agent loops only"
        )
    sampled_logprobs = rollout_log_probs[held].float()
    rebuilt_ids, rebuilt_logprobs = sampled_slot(top_ids, top_logprobs, tokens, sampled_logprobs)
    differs = (slot_ids != rebuilt_ids) | (_bits(slot_logprobs) != _bits(rebuilt_logprobs))
    differs &= generated[held]
    if bool(differs.any()):
        row = int(torch.nonzero(differs)[0])
        sample, position = (int(i) for i in torch.nonzero(held)[row])
        raise RuntimeError(
            f"pdmctl: response {sample}, position {position}: the support's slot K (id {int(slot_ids[row])}, "
            f"log-prob {float(slot_logprobs[row])!r}) is not the sampled token {int(tokens[row])} with VeRL's "
            f"rollout log-prob {float(sampled_logprobs[row])!r}; the carry rebuilds slot K from those two"
        )
    ids_out, logprobs_out = np.empty(bsz, dtype=object), np.empty(bsz, dtype=object)
    ids_np, logprobs_np = top_ids.numpy(), top_logprobs.numpy()
    for i, (start, end) in enumerate(pairwise([0, *lengths.cumsum(0).tolist()])):
        ids_out[i], logprobs_out[i] = ids_np[start:end], logprobs_np[start:end]
    return ids_out, logprobs_out


def _rows(supports: Sequence[RolloutTopK], field: str, lengths: torch.Tensor, columns: Any) -> torch.Tensor:
    """The supports' first `lengths[i]` rows of `columns`, response after response, in one new tensor."""
    parts = [getattr(support, field)[:t, columns] for support, t in zip(supports, lengths.tolist(), strict=True)]
    return torch.cat(parts) if parts else getattr(supports, field, torch.empty(0))


def carried_rows(value: Any, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rows, carried)`: the carried `[K]` row of each response token where `valid` (`[bsz, width]`,
    in `tensor[valid]` order), and whether the carry holds that position at all (it holds a response's
    first T_i). `value` is the field as a micro-batch holds it: per-sample arrays (V0: the DataProto's
    object array, a `NonTensorStack` in the TensorDict), a nested tensor (V1: per-sample fields in
    TransferQueue), or one `[bsz, T, K]` tensor (V1 stacks samples of one length)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        values, lengths = value.values(), value.offsets().diff()
    elif isinstance(value, torch.Tensor):
        values, lengths = value.reshape(-1, value.shape[-1]), torch.full((value.shape[0],), value.shape[1])
    else:  # a list of arrays; one array where a one-sample stack came back as its single item
        samples = [value] if isinstance(value, np.ndarray) and value.dtype != object else [np.asarray(x) for x in value]
        values = torch.from_numpy(np.concatenate(samples))
        lengths = torch.tensor([sample.shape[0] for sample in samples])
    sample, position = torch.nonzero(valid, as_tuple=True)
    lengths = lengths.to(values.device)
    sample, position = sample.to(values.device), position.to(values.device)
    carried = position < lengths[sample]
    index = (lengths.cumsum(0) - lengths)[sample] + position
    if not values.shape[0]:  # nothing carried (responses of no tokens)
        return values.new_zeros(len(index), values.shape[-1]), carried
    if len(index) == values.shape[0] and torch.equal(index, torch.arange(len(index), device=index.device)):
        return values, carried  # single-turn: every carried row, in order, and nothing else
    return values[index.masked_fill(~carried, 0)], carried
