"""Rollout top-K log-probs through VeRL 0.9.1, and the actor-side call into `pdmctl.masks`.

VeRL 0.9.1 keeps only the sampled token's rollout log-prob. The top-K masks need,
per generated token, the rollout's `TopK(μ) ∪ {k}` (ids and log-probs) and the
training logits over the whole vocabulary. This module is the one place that
knows how VeRL 0.9.1 is built inside; it refuses any other version
(`check_verl_version`), because every function it wraps is private API.

Three layers, from pure to invasive:

1. `extract_topk` / `carry_topk`: vLLM's per-position logprob dicts (values with
   vLLM's `rank` and `logprob` fields) -> fixed-width `[T, K+1]` ids and
   log-probs, and the batch's layout of them: per response, unpadded, `[T_i, K]`
   int32 ids and float32 log-probs (slot K rebuilt on the actor). Pure; tested on
   CPU with vLLM-shaped objects.
2. `pdm_ppo_loss`: the actor's loss function, used twice per micro-batch the way
   VeRL's own top-K distillation loss is (`verl/trainer/distillation/losses.py`):
   called with `student_logits` it is the engine's logits processor and runs
   `pdmctl.masks.token_diagnostics` on the full (temperature-scaled) logits; called
   with `model_output` it hands those diagnostics to VeRL's unmodified `ppo_loss`,
   which finds the registered `pdmctl_<method>` loss. Tested on CPU through
   VeRL's own `ppo_loss` and `logprobs_from_logits`.
3. `install`: monkeypatches of VeRL's vLLM server (request `logprobs=K`, keep
   `TopK ∪ {k}` in `TokenOutput.extra_fields`), the agent loop (extra fields ->
   the batch's per-response arrays) and the actor worker (use `pdm_ppo_loss`, switch the
   logits-processor hook on). NOT exercised here: it needs vLLM and a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from operator import attrgetter, methodcaller
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from pdmctl import masks

SUPPORTED_VERL_VERSION = "0.9.1"
CARRY_ID_MAX = 2**31 - 1  # the carry holds token ids as int32 (carry_topk)
TOPK_ENV = "PDMCTL_VERL_TOPK"  # K for the rollout; set by the job body, read by every Ray worker
_MASK_CHUNK_ROWS = 1024  # response tokens per token_diagnostics call: bounds the [rows, V] scratch

# Batch keys this module adds ([bsz, response_length, K+1]); model_output keys it adds ([bsz, seq] nested).
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


_DUMPED: set[str] = set()


def dump_once(kind: str, **tensors: Any) -> None:
    """With `PDMCTL_VERL_DUMP_DIR` set: save this process's first `kind` record (the engine tests read it).

    The logits processor and the loss run once per micro-batch in that order, so the first
    `logits` and the first `loss` record of a process describe the same micro-batch.
    """
    directory = os.environ.get(DUMP_ENV)
    if not directory or kind in _DUMPED:
        return
    _DUMPED.add(kind)
    path = Path(directory) / f"{kind}-{os.getpid()}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    values = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    torch.save(values, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)  # a reader never sees half a file


def _profile(started: float, rows: int) -> None:
    """With `PDMCTL_VERL_PROFILE_DIR` set: one JSON line per mask computation (bench/engine.py sums them
    against VeRL's `timing_s/*` to give the share of the actor's step spent in the mask)."""
    ended = time.perf_counter()
    directory = os.environ[PROFILE_ENV]
    Path(directory).mkdir(parents=True, exist_ok=True)
    line = json.dumps({"pid": os.getpid(), "end": time.time(), "s": ended - started, "rows": rows})
    with open(Path(directory) / f"mask-{os.getpid()}.jsonl", "a") as fh:
        fh.write(line + "\n")


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
            f"install the pinned version (pip install 'pdmctl[verl]') or port pdmctl/backends/verl/topk.py"
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


# ---------------------------------------------------------------------------
# 2. The actor side: logits processor + VeRL's ppo_loss
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MaskSettings:
    """What `token_diagnostics` needs besides tensors, read off VeRL's ActorConfig."""

    method: str
    divergence: str
    estimator: str
    delta: float
    delta_low: float | None
    eps_low: float
    eps_high: float
    ratio_cap: float

    @classmethod
    def from_actor_config(cls, config: Any) -> MaskSettings:
        policy_loss = config.policy_loss
        return cls(
            method=method_of_loss(policy_loss.loss_mode),
            divergence=policy_loss.get("divergence", "topk_kl"),
            estimator=policy_loss.get("estimator", "agg"),
            delta=float(policy_loss.get("delta", 0.15)),
            delta_low=policy_loss.get("delta_low", None),
            eps_low=float(config.clip_ratio_low),
            eps_high=float(config.clip_ratio_high),
            ratio_cap=float(config.clip_ratio_c),
        )


# The padded [bsz, response_length] diagnostics of the micro-batch whose loss VeRL is computing.
_CURRENT: contextvars.ContextVar[masks.Diagnostics | None] = contextvars.ContextVar(
    "pdmctl_diagnostics", default=None
)


def current_diagnostics() -> masks.Diagnostics:
    """The diagnostics `pdm_ppo_loss` computed for this micro-batch (called by the registered losses)."""
    diagnostics = _CURRENT.get()
    if diagnostics is None:
        raise RuntimeError(
            "a pdmctl_* policy loss was called outside pdmctl's actor loss: the VeRL top-K patch is not "
            f"installed in this worker (set {TOPK_ENV} and load pdmctl.backends.verl.plugin in every Ray worker)"
        )
    return diagnostics


@contextlib.contextmanager
def diagnostics_scope(diagnostics: masks.Diagnostics) -> Iterator[None]:
    token = _CURRENT.set(diagnostics)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def response_rows(data: Any, total_rows: int) -> torch.Tensor:
    """[bsz, response_length] row index into the packed logits of each response token's logits.

    Built with VeRL's own `no_padding_2_padding` on an arange, so it is exactly the
    alignment VeRL uses to slice `log_probs` (logits at row p predict token p+1).
    """
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(torch.arange(total_rows), data).long()


def _dense(data: Any, key: str) -> torch.Tensor:
    """A field as one right-padded tensor. A nested field is padded from its samples' own lengths:
    `to_padded_tensor` pads to the jagged tensor's cached maximum, which a micro-batch sliced out of
    V1's batch keeps from the whole batch (a [2, 4, 6] top-K came out [2, 8, 6])."""
    value = data[key]
    if not value.is_nested:
        return value
    return torch.nn.utils.rnn.pad_sequence(list(value.unbind()), batch_first=True, padding_value=0)


@dataclass(frozen=True)
class ResponseTokens:
    """The mask's per-token inputs for every response token of a micro-batch ([M] or [M, K+1])."""

    sampled_ids: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor
    advantages: torch.Tensor


def response_tokens(data: Any, total_rows: int, device: torch.device) -> tuple[torch.Tensor, ResponseTokens]:
    """`(rows, tokens)`: each response token's row in the packed, unpadded sequences, and its inputs."""
    if "rollout_log_probs" not in data.keys():  # noqa: SIM118  (TensorDict has no `in`)
        raise RuntimeError(
            "pdmctl losses need the rollout's sampled log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    if TOPK_IDS_KEY not in data.keys():  # noqa: SIM118
        raise RuntimeError(
            f"pdmctl losses need {TOPK_IDS_KEY}/{TOPK_LOGPROBS_KEY} in the batch: the rollout top-K patch is not active"
        )
    valid = _dense(data, "response_mask").bool().to(device)
    rows = response_rows(data, total_rows).to(device)[valid]
    sampled_ids = _dense(data, "responses").to(device)[valid].long()
    sampled_logprobs = _dense(data, "rollout_log_probs").to(device)[valid].float()
    from verl.utils import tensordict_utils as tu

    # tu.get: a NonTensorStack as the list of its arrays, a tensor as it is
    top_ids, carried = _carried_rows(tu.get(data, TOPK_IDS_KEY), valid)
    top_logprobs, _ = _carried_rows(tu.get(data, TOPK_LOGPROBS_KEY), valid)
    top_ids, top_logprobs = top_ids.to(device).long(), top_logprobs.to(device).float()
    carried = carried.to(device)
    # rows the carry does not hold read as `extract_topk`'s padding (id 0, log-prob -inf), slot K included
    top_ids = top_ids.masked_fill(~carried[:, None], 0)
    top_logprobs = top_logprobs.masked_fill(~carried[:, None], -math.inf)
    slot_ids, slot_logprobs = sampled_slot(top_ids, top_logprobs, sampled_ids, sampled_logprobs)
    tokens = ResponseTokens(
        sampled_ids=sampled_ids,
        topk_ids=torch.cat([top_ids, slot_ids.masked_fill(~carried, 0)[:, None]], -1),
        topk_logprobs=torch.cat([top_logprobs, slot_logprobs.masked_fill(~carried, -math.inf)[:, None]], -1),
        sampled_logprobs=sampled_logprobs,
        advantages=_dense(data, "advantages").to(device)[valid].float(),
    )
    return rows, tokens


def _carried_rows(value: Any, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def diagnose_rows(
    settings: MaskSettings,
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: ResponseTokens,
    shard: masks.VocabShard | None = None,
) -> dict[str, torch.Tensor]:
    """`token_diagnostics` on `logits[rows]` (in chunks), scattered into `(1, len(logits))` outputs.

    With a `shard`, every rank of its group must call this with the same rows and tokens.
    """
    started = time.perf_counter()
    outputs = {
        name: torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        for name in DIAGNOSTIC_KEYS
    }
    with torch.no_grad():
        for start in range(0, rows.numel(), _MASK_CHUNK_ROWS):
            chunk = slice(start, start + _MASK_CHUNK_ROWS)
            d = masks.token_diagnostics(
                logits[rows[chunk]].detach(), tokens.sampled_ids[chunk], tokens.topk_ids[chunk],
                tokens.topk_logprobs[chunk], tokens.sampled_logprobs[chunk], tokens.advantages[chunk],
                method=settings.method, divergence=settings.divergence, estimator=settings.estimator,
                delta=settings.delta, delta_low=settings.delta_low, eps_low=settings.eps_low,
                eps_high=settings.eps_high, shard=shard,
            )  # fmt: skip
            for name in DIAGNOSTIC_KEYS:
                outputs[name][rows[chunk]] = getattr(d, name).float()
    if os.environ.get(PROFILE_ENV):
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)  # time the work, not its launch (profiling only)
        _profile(started, rows.numel())
    return {_OUTPUT_PREFIX + name: value.unsqueeze(0) for name, value in outputs.items()}


def mask_outputs_from_logits(config: Any, data: Any, student_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logits-processor half for FSDP engines: rows are the packed, unpadded sequences.

    `student_logits` is `(1, total_rows, V)`, already divided by the temperature (the
    engine does that before it calls a logits processor). Returns one `(1, total_rows)`
    float tensor per diagnostic, zero on prompt rows, as VeRL's hook requires.
    """
    logits = student_logits.squeeze(0)
    rows, tokens = response_tokens(data, logits.shape[0], logits.device)
    settings = MaskSettings.from_actor_config(config)
    dump_once(
        "logits", logits=logits[rows], settings=dataclasses.asdict(settings), **dataclasses.asdict(tokens)
    )
    return diagnose_rows(settings, logits, rows, tokens)


def megatron_fp8_padding(config: Any) -> bool:
    """Whether Megatron pads the packed rows for fp8 (as `gptmodel_forward_model_engine` decides)."""
    megatron = getattr(config, "megatron", None)
    override = getattr(megatron, "override_transformer_config", None) or {}
    return override.get("fp8", None) in ("e4m3", "hybrid")


def megatron_mask_outputs(
    config: Any, data: Any, student_logits: torch.Tensor, data_format: str
) -> dict[str, torch.Tensor]:
    """The logits-processor half for Megatron: vocabulary-parallel logits in Megatron's packed layout.

    `student_logits` is `(1, local_rows, V / TP)`: this context-parallel rank's rows of the
    sequences packed with Megatron's alignment padding (TP x CP, and fp8's when the model
    trains in fp8), and this tensor-parallel rank's vocabulary columns. The per-token inputs
    are laid out on the unpadded sequences, packed by VeRL's own `preprocess_thd_engine` the
    way the engine packs the logits (zigzag CP, VeRL's default), and diagnosed with a
    `VocabShard` over the TP group; the engine unpacks the `(1, local_rows)` outputs.
    """
    if data_format != "thd":
        raise NotImplementedError(
            "pdmctl's Megatron logits processor needs the packed THD layout (use_remove_padding=true)"
        )
    from megatron.core import parallel_state as mpu
    from verl.models.mcore.util import preprocess_thd_engine

    logits = student_logits.squeeze(0)
    offsets = data["input_ids"].offsets().to(logits.device)
    total = int(offsets[-1])
    rows, t = response_tokens(data, total, logits.device)
    width = t.topk_ids.shape[-1]
    ints = torch.zeros(total, 1 + width, dtype=torch.long, device=logits.device)
    ints[rows] = torch.cat([t.sampled_ids[:, None], t.topk_ids], -1)
    floats = torch.zeros(total, width + 3, dtype=torch.float32, device=logits.device)
    ones = torch.ones_like(t.advantages)[:, None]  # the last column marks response tokens
    floats[rows] = torch.cat([t.topk_logprobs, t.sampled_logprobs[:, None], t.advantages[:, None], ones], -1)
    fp8 = megatron_fp8_padding(config)

    def packed(x: torch.Tensor) -> torch.Tensor:
        nested = torch.nested.nested_tensor_from_jagged(x, offsets)
        return preprocess_thd_engine(nested, pre_process=True, use_fp8_padding=fp8)[0].squeeze(0)

    ints, floats = packed(ints), packed(floats)
    if ints.shape[0] != logits.shape[0]:
        raise RuntimeError(
            f"pdmctl: Megatron packed {logits.shape[0]} rows of logits but the token inputs pack to "
            f"{ints.shape[0]} (fp8 padding {fp8}); the engine's layout is not the one this patch was written for"
        )
    local_rows = torch.nonzero(floats[:, -1] > 0.5).squeeze(-1)
    tokens = ResponseTokens(
        sampled_ids=ints[local_rows, 0], topk_ids=ints[local_rows, 1:],
        topk_logprobs=floats[local_rows, :width], sampled_logprobs=floats[local_rows, width],
        advantages=floats[local_rows, width + 1],
    )  # fmt: skip
    v_local = logits.shape[-1]
    shard = masks.VocabShard(
        start=mpu.get_tensor_model_parallel_rank() * v_local,
        vocab_size=mpu.get_tensor_model_parallel_world_size() * v_local,
        group=mpu.get_tensor_model_parallel_group(),
    )
    return diagnose_rows(MaskSettings.from_actor_config(config), logits, local_rows, tokens, shard)


def diagnostics_from_model_output(model_output: Mapping[str, torch.Tensor], data: Any) -> masks.Diagnostics:
    """The logits processor's per-row outputs -> `[bsz, response_length]` Diagnostics."""
    from verl.workers.utils.padding import no_padding_2_padding

    padded = {
        name: no_padding_2_padding(model_output[_OUTPUT_PREFIX + name], data) for name in DIAGNOSTIC_KEYS
    }
    as_bool = ("keep", "out_of_region", "disagree")
    return masks.Diagnostics(**{name: (v > 0.5) if name in as_bool else v for name, v in padded.items()})


def pdm_ppo_loss(
    config: Any,
    model_output: Mapping[str, torch.Tensor] | None = None,
    data: Any = None,
    dp_group: Any = None,
    student_logits: torch.Tensor | None = None,
    data_format: str = "thd",
) -> Any:
    """The actor loss for `pdmctl_*` loss modes; same two-call contract as VeRL's `distillation_ppo_loss`."""
    if student_logits is not None:
        if config.strategy == "megatron":
            return megatron_mask_outputs(config, data, student_logits, data_format)
        if data_format != "thd" or _sequence_parallel_size() > 1:
            raise NotImplementedError(
                "pdmctl's FSDP logits processor maps packed rows without Ulysses sequence parallelism only "
                "(ulysses_sequence_parallel_size=1)"
            )
        return mask_outputs_from_logits(config, data, student_logits)
    from verl.workers.utils.losses import ppo_loss

    from pdmctl.backends.verl import progress

    with diagnostics_scope(diagnostics_from_model_output(model_output, data)):
        result = ppo_loss(config, model_output, data, dp_group)
    progress.add("microbatches")  # the job's stall watchdog reads it (progress.py)
    return result


def _sequence_parallel_size() -> int:
    with contextlib.suppress(Exception):
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size

        return int(get_ulysses_sequence_parallel_world_size())
    return 1


# ---------------------------------------------------------------------------
# 3. The monkeypatches (need vLLM + GPU workers; not exercised on CPU)
# ---------------------------------------------------------------------------


def configured_topk() -> int:
    """K from the environment the job body exports to every Ray worker; 0 = the patch is off."""
    raw = os.environ.get(TOPK_ENV, "0")
    try:
        return int(raw)
    except ValueError as err:
        raise ValueError(f"{TOPK_ENV}: expected an integer K, got {raw!r}") from err


_INSTALLED: set[str] = set()
_ANNOUNCED: set[str] = set()
_K = [0]  # the K the installed patches use; the latest `install` sets it (one K per process)


def install(k: int | None = None) -> None:
    """Patch VeRL 0.9.1 to carry rollout top-K and to call pdmctl's actor loss. Idempotent.

    Each part is installed only where its module imports: the vLLM server exists
    only where vLLM is installed, the actor worker only where its engines import.
    """
    check_verl_version()
    k = configured_topk() if k is None else k
    if k < 1:
        return
    _K[0] = k
    _patch_actor_worker()
    _patch_agent_loop()
    _patch_agent_loop_tq()
    _patch_vllm_server()


def announce(what: str) -> None:
    """`pdmctl: <what> on <host> (pid N)`, once per process: where VeRL placed its actor ranks and
    rollout servers. Ray passes a worker's output to the driver, so it reaches the job log (read by
    tests/test_verl_multinode.py: the actor's ranks and the rollout on both nodes)."""
    import socket

    if what in _ANNOUNCED:
        return
    _ANNOUNCED.add(what)
    print(f"pdmctl: {what} on {socket.gethostname()} (pid {os.getpid()})", flush=True)


def _actor_rank() -> str:
    """`rank R of W` of this actor process (VeRL's worker group sets RANK and WORLD_SIZE)."""
    return f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}"


def _patch_actor_worker() -> None:
    """Use `pdm_ppo_loss` when the loss mode is pdmctl's, and switch VeRL's logits-processor hook on."""
    if "actor" in _INSTALLED:
        return
    from verl.workers import engine_workers

    original_init_model = engine_workers.ActorRolloutRefWorker.init_model
    original_train_batch = engine_workers.TrainingWorker.train_batch

    @functools.wraps(original_init_model)
    def init_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        # VeRL's checkpoint rotation told what earlier attempts kept; here, in the actor process, not at the
        # plugin's import: importing VeRL's checkpoint manager resolves VeRL's platform, and a vLLM worker
        # imports the plugin before the CPU platform is registered ("Unknown platform 'cpu'", seen)
        from pdmctl.backends.verl import checkpoints

        checkpoints.install()
        result = original_init_model(self, *args, **kwargs)
        if getattr(self, "actor", None) is not None and is_pdmctl_loss(
            self.config.actor.policy_loss.loss_mode
        ):
            self.loss_fn = functools.partial(pdm_ppo_loss, config=self.loss_fn.keywords["config"])
            self.actor.set_loss_fn(self.loss_fn)
        if getattr(self, "actor", None) is not None:
            announce(f"actor {_actor_rank()} initialised")
        return result

    @functools.wraps(original_train_batch)
    def train_batch(self: Any, data: Any) -> Any:
        # The engines call a loss function as logits processor only under this flag (its
        # only user in 0.9.1 is top-K distillation, which pdmctl runs never enable).
        if getattr(self.loss_fn, "func", None) is pdm_ppo_loss:
            from verl.utils import tensordict_utils as tu

            tu.assign_non_tensor(data, distillation_use_topk=True)
        result = original_train_batch(self, data)
        announce(f"actor {_actor_rank()} trained a batch")
        return result

    engine_workers.ActorRolloutRefWorker.init_model = init_model
    engine_workers.TrainingWorker.train_batch = train_batch
    _INSTALLED.add("actor")


def _patch_agent_loop() -> None:
    """Put each response's top-K from `extra_fields` into the batch as `carry_topk` lays it out."""
    if "agent_loop" in _INSTALLED:
        return
    from verl.experimental.agent_loop import agent_loop

    original = agent_loop.AgentLoopWorker._postprocess

    @functools.wraps(original)
    def _postprocess(self: Any, inputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        k = _K[0]
        supports = [_support_from_extra_fields(item.extra_fields) for item in inputs]
        output = original(self, inputs, *args, **kwargs)
        batch = output.batch
        sampled_logprobs = _rollout_log_probs(batch.get("rollout_log_probs", None))
        ids, logprobs = carry_topk(supports, batch["responses"], batch["response_mask"], sampled_logprobs, k)
        # VeRL's _postprocess put every extra field in non_tensor_batch as an object array: these replace
        # the server's [T, K+1] ones
        output.non_tensor_batch[TOPK_IDS_KEY] = ids
        output.non_tensor_batch[TOPK_LOGPROBS_KEY] = logprobs
        return output

    agent_loop.AgentLoopWorker._postprocess = _postprocess
    _INSTALLED.add("agent_loop")


def v1_available() -> bool:
    """Whether VeRL's V1 trainer can run here: its agent loop needs TransferQueue. Looked up, not
    imported: importing VeRL's trainer from a worker's plugin import would ask for the device
    platform before cpu.py has registered it."""
    return importlib.util.find_spec("transfer_queue") is not None


def _patch_agent_loop_tq() -> None:
    """The V1 trainer: each output's top-K becomes two per-sample tensor fields in TransferQueue.

    V1's `_agent_loop_postprocess` turns every AgentLoopOutput into a dict of per-sample fields
    (`responses` [T], `rollout_log_probs` [T], ...) and stores them with one
    `list_of_dict_to_tensordict` call; the actor's `update_actor` then fetches every field of its
    keys. pdmctl moves the top-K lists from `extra_fields` into `rollout_topk_ids` /
    `rollout_topk_logprobs` [T, K] there (`carry_topk`'s layout, one sample), checked as in V0. The
    function is wrapped where VeRL defines it (a light module), before the V1 agent loop imports
    it by name; dicts without top-K lists pass through untouched.
    """
    if "agent_loop_tq" in _INSTALLED:
        return
    from verl.utils import tensordict_utils

    original = tensordict_utils.list_of_dict_to_tensordict

    @functools.wraps(original)
    def list_of_dict_to_tensordict(fields: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        for field in fields:
            extra = field.get("extra_fields")
            if isinstance(extra, dict) and TOPK_IDS_KEY in extra and "responses" in field:
                support = _support_from_extra_fields(extra)
                rollout_log_probs = _rollout_log_probs(field.get("rollout_log_probs"))
                responses, response_mask = field["responses"][None], field["response_mask"][None]
                ids, logprobs = carry_topk([support], responses, response_mask, rollout_log_probs[None], _K[0])
                field[TOPK_IDS_KEY] = torch.from_numpy(ids[0])
                field[TOPK_LOGPROBS_KEY] = torch.from_numpy(logprobs[0])
                for key in (TOPK_IDS_KEY, TOPK_LOGPROBS_KEY):
                    extra.pop(key, None)
        return original(fields, *args, **kwargs)

    tensordict_utils.list_of_dict_to_tensordict = list_of_dict_to_tensordict
    for name in ("verl.trainer.ppo.v1.agent_loop_tq", "verl.trainer.ppo.padding_utils"):
        module = sys.modules.get(name)  # imported before this patch: rebind its copy of the name
        if module is not None:
            module.list_of_dict_to_tensordict = list_of_dict_to_tensordict
    _INSTALLED.add("agent_loop_tq")


def _rollout_log_probs(value: torch.Tensor | None) -> torch.Tensor:
    if value is None:
        raise RuntimeError(
            "pdmctl losses need the rollout's sampled log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    return value


def _support_from_extra_fields(extra_fields: Mapping[str, Any]) -> RolloutTopK:
    ids = extra_fields.get(TOPK_IDS_KEY)
    if ids is None:
        raise RuntimeError("a rollout came back without top-K log-probs: the vLLM server patch is not active")
    # the server's int32 arrays, taken without a copy (lists, from older servers or tests: int64)
    return RolloutTopK(torch.as_tensor(ids), torch.as_tensor(extra_fields[TOPK_LOGPROBS_KEY]))


def _patch_vllm_server() -> None:
    """Request `logprobs=K` from vLLM and keep `TopK ∪ {k}` per generated token."""
    if "vllm" in _INSTALLED:
        return
    try:
        from verl.workers.rollout.vllm_rollout import vllm_async_server as server
    except (ImportError, ValueError):  # no vLLM on this node (the driver, CPU tests): verl raises either
        return

    original_sampling_params = server.SamplingParams
    original_generate = server.vLLMHttpServer.generate

    def sampling_params(*args: Any, **kwargs: Any) -> Any:
        # VeRL asks for `logprobs=0` (the sampled token only) when calculate_log_probs is on.
        if kwargs.get("logprobs") == 0:
            kwargs["logprobs"] = _K[0]
            # flat lists instead of a {token_id: Logprob} dict per position: vLLM builds K+1 objects
            # less per token, `extract_topk` reads the lists as arrays (bench/topk.py); VeRL's own
            # read of the sampled token's log-prob takes it as the sequence of dicts it still is
            if "flat_logprobs" in getattr(original_sampling_params, "__struct_fields__", ()):
                kwargs.setdefault("flat_logprobs", True)
        return original_sampling_params(*args, **kwargs)

    @functools.wraps(original_generate)
    async def generate(
        self: Any, prompt_ids: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> Any:
        if os.environ.get(FAIL_ENV) == "rollout":
            raise RuntimeError(f"pdmctl: failure injected in the rollout worker ({FAIL_ENV}=rollout)")
        announce(f"rollout server {getattr(self, 'replica_rank', '?')} generates")
        captured = _capture_final_outputs(self)
        output = await original_generate(self, prompt_ids, sampling_params, request_id, **kwargs)
        final = captured.pop(request_id, None)
        if final is not None and final.outputs and final.outputs[0].logprobs is not None:
            support = extract_topk(final.outputs[0].token_ids, final.outputs[0].logprobs, _K[0])
            if "flat-seen" not in _INSTALLED and _is_flat(final.outputs[0].logprobs):
                _INSTALLED.add("flat-seen")  # once per server process: the engine test looks for it
                print(f"pdmctl: top-K read from vLLM's flat logprobs ({FLAT_LOGPROBS_LINE})", flush=True)
            # numpy arrays, not lists nor tensors: Ray pickles an array's buffer out of band, about
            # memory speed, where a [8192, 21] tensor pickled ~4x slower and the nested lists ~30x; the
            # agent loop takes them back with `torch.as_tensor`, without a copy (bench/topk.py). Ids in
            # 32 bits, as the batch carries them (carry_topk)
            output.extra_fields[TOPK_IDS_KEY] = int32_ids(support.ids).numpy()
            output.extra_fields[TOPK_LOGPROBS_KEY] = support.logprobs.numpy()
        return output

    server.SamplingParams = sampling_params
    server.vLLMHttpServer.generate = generate
    _INSTALLED.add("vllm")


def _capture_final_outputs(server_instance: Any) -> dict[str, Any]:
    """Wrap this server's engine.generate once so the last RequestOutput per request is kept."""
    captured: dict[str, Any] | None = getattr(server_instance, "_pdmctl_final_outputs", None)
    if captured is not None:
        return captured
    from pdmctl.backends.verl import progress

    captured = {}
    engine_generate = server_instance.engine.generate

    async def generate(*args: Any, request_id: str, **kwargs: Any) -> Any:
        tokens = 0
        async for item in engine_generate(*args, request_id=request_id, **kwargs):
            captured[request_id] = item
            # the tokens generated so far (vLLM streams cumulative outputs): the job's stall watchdog reads
            # them, so that a rollout that prints nothing for minutes is not taken for a hang (progress.py)
            now = sum(len(getattr(out, "token_ids", ()) or ()) for out in getattr(item, "outputs", ()) or ())
            progress.add("tokens", now - tokens if now >= tokens else now)
            tokens = now
            yield item

    server_instance.engine.generate = generate
    server_instance._pdmctl_final_outputs = captured
    return captured
