"""The per-token loop `topk.extract_topk` was before it was vectorised (commit 49e0c0d), kept as the
reference the vectorised version is tested against (tests/test_verl_topk.py) and timed against
(bench/topk.py); and vLLM-shaped rollout outputs for both.

Also the padded layout the batch carried the top-K in until 634251f (`reference_pad_topk`: every response
padded to `[response_length, K+1]`, int64 ids) and the actor's read of it (`reference_response_tokens`),
kept verbatim: the carried layout (`topk.carry_topk`) is tested to give the same mask, bit for bit
(tests/test_verl_loss.py), and measured against it (bench/topk.py)."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdmctl.backends.verl import actor_loss, topk
from pdmctl.backends.verl.actor_loss import ResponseTokens
from pdmctl.backends.verl.topk import RolloutTopK, VllmLogprob


@dataclass
class Logprob:  # the fields of vllm.sequence.Logprob
    logprob: float
    rank: int | None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs:  # the fields of vllm.logprobs.FlatLogprobs (SamplingParams(flat_logprobs=True))
    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int | None]
    decoded_tokens: list[str | None]

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, position: int) -> dict[int, Logprob]:  # what VeRL's own read gets
        span = range(self.start_indices[position], self.end_indices[position])
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i]) for i in span}


def flatten(positions: Sequence[Mapping[int, Logprob]], gap: int = 0) -> FlatLogprobs:
    """The same positions as vLLM's flat lists (dict order kept); `gap` unused entries between ranges."""
    flat = FlatLogprobs([], [], [], [], [], [])
    for entries in positions:
        for _ in range(gap):
            flat.token_ids.append(-1), flat.logprobs.append(0.0), flat.ranks.append(1), flat.decoded_tokens.append(None)
        flat.start_indices.append(len(flat.token_ids))
        for tid, lp in entries.items():
            flat.token_ids.append(tid), flat.logprobs.append(lp.logprob), flat.ranks.append(lp.rank)
            flat.decoded_tokens.append(None)
        flat.end_indices.append(len(flat.token_ids))
    return flat


def reference_extract_topk(
    token_ids: Sequence[int], position_logprobs: Sequence[Mapping[int, VllmLogprob]], k: int
) -> RolloutTopK:
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    if len(token_ids) != len(position_logprobs):
        raise ValueError(
            f"token_ids ({len(token_ids)}) and logprobs ({len(position_logprobs)}) differ in length"
        )
    n = len(token_ids)
    ids = torch.zeros((n, k + 1), dtype=torch.int64)
    logprobs = torch.full((n, k + 1), -math.inf, dtype=torch.float32)
    for t, (sampled, entries) in enumerate(zip(token_ids, position_logprobs, strict=True)):
        ranked = sorted(entries.items(), key=lambda item: _rank_key(item[1]))
        top = [(tid, lp) for tid, lp in ranked if lp.rank is None or lp.rank <= k][:k]
        for slot, (tid, lp) in enumerate(top):
            ids[t, slot] = tid
            logprobs[t, slot] = lp.logprob
        if all(tid != sampled for tid, _ in top):
            if sampled not in entries:
                raise ValueError(f"position {t}: vLLM returned no log-prob for the sampled token {sampled}")
            ids[t, k] = sampled
            logprobs[t, k] = entries[sampled].logprob
    return RolloutTopK(ids, logprobs)


def _rank_key(lp: VllmLogprob) -> tuple[float, float]:
    return (math.inf if lp.rank is None else float(lp.rank), -float(lp.logprob))


def vllm_response(
    rng: random.Random, length: int, k: int, vocab: int = 151_936, p_outside: float = 0.1
) -> tuple[list[int], list[dict[int, Logprob]]]:
    """One response as vLLM returns it with `logprobs=k`: per position the top-k by rank and the sampled
    token (first in the dict, as vLLM puts it; with its own rank > k when outside the top-k): the dicts
    that `vllm_flat_response`'s flat lists stand for (vLLM builds the same ones without flat_logprobs)."""
    tokens, flat = vllm_flat_response(rng, length, k, vocab, p_outside)
    return tokens, [flat[t] for t in range(len(flat))]


def vllm_flat_response(
    rng: random.Random, length: int, k: int, vocab: int = 151_936, p_outside: float = 0.1
) -> tuple[list[int], FlatLogprobs]:
    """One response as vLLM 0.24 returns it with `logprobs=k, flat_logprobs=True`: per position K+1
    entries, the sampled token with its rank first, then the top-k by rank 1..k (the sampled token
    again where it is among them: `vllm.logprobs.append_logprobs_for_next_position`)."""
    tokens: list[int] = []
    flat = FlatLogprobs([], [], [], [], [], [])
    for _ in range(length):
        top_ids = rng.sample(range(vocab), k + 1)
        lps = sorted((-rng.expovariate(0.5) for _ in range(k + 1)), reverse=True)
        if rng.random() < p_outside:
            sampled, rank, lp = top_ids[k], rng.randint(k + 1, 5 * k), lps[k] - rng.expovariate(1.0)
        else:
            slot = rng.randrange(k)
            sampled, rank, lp = top_ids[slot], slot + 1, lps[slot]
        flat.start_indices.append(len(flat.token_ids))
        flat.token_ids += [sampled, *top_ids[:k]]
        flat.logprobs += [lp, *lps[:k]]
        flat.ranks += [rank, *range(1, k + 1)]
        flat.decoded_tokens += [None] * (k + 1)
        flat.end_indices.append(len(flat.token_ids))
        tokens.append(sampled)
    return tokens, flat


def reference_pad_topk(responses: Sequence[RolloutTopK], response_length: int, k: int) -> RolloutTopK:
    """Stack per-response supports into `[bsz, response_length, K+1]`, right-padded like VeRL's responses."""
    # empty, each row's padding filled after its copy: every byte of the batch written once
    ids = torch.empty((len(responses), response_length, k + 1), dtype=torch.int64)
    logprobs = torch.empty((len(responses), response_length, k + 1), dtype=torch.float32)
    for i, r in enumerate(responses):
        if r.ids.shape[-1] != k + 1:
            raise ValueError(f"response {i}: width {r.ids.shape[-1]} != K+1 = {k + 1}")
        t = min(r.ids.shape[0], response_length)
        ids[i, :t] = r.ids[:t]
        logprobs[i, :t] = r.logprobs[:t]
        ids[i, t:] = 0
        logprobs[i, t:] = -math.inf
    return RolloutTopK(ids, logprobs)


def reference_response_tokens(data: Any, total_rows: int, device: torch.device) -> tuple[torch.Tensor, ResponseTokens]:
    """`actor_loss.response_tokens` as it read the padded layout (the two checks of missing fields left out)."""
    dense = actor_loss._dense
    valid = dense(data, "response_mask").bool().to(device)
    rows = actor_loss.response_rows(data, total_rows).to(device)[valid]
    tokens = ResponseTokens(
        sampled_ids=dense(data, "responses").to(device)[valid].long(),
        topk_ids=dense(data, topk.TOPK_IDS_KEY).to(device)[valid].long(),
        topk_logprobs=dense(data, topk.TOPK_LOGPROBS_KEY).to(device)[valid].float(),
        sampled_logprobs=dense(data, "rollout_log_probs").to(device)[valid].float(),
        advantages=dense(data, "advantages").to(device)[valid].float(),
    )
    return rows, tokens


def reference_check_alignment(padded: RolloutTopK, responses: torch.Tensor, response_mask: torch.Tensor) -> None:
    """`check_alignment` until 634251f, on the padded layout (`topk.carry_topk` checks the same now).

    Every generated token must be in its own row's `TopK ∪ {k}`: the rows line up with the tokens.

    A multi-turn agent loop (tool tokens in the response) or a token builder that edits the
    generated ids would shift them; the mask would then read another token's top-K, silently.
    """
    generated = response_mask.bool()
    found = ((padded.ids == responses.unsqueeze(-1)) & torch.isfinite(padded.logprobs)).any(-1)
    missing = generated & ~found
    if bool(missing.any()):
        sample, position = (int(i) for i in torch.nonzero(missing)[0])
        raise RuntimeError(
            f"pdmctl: the rollout top-K rows do not line up with the response tokens ({int(missing.sum())} "
            f"generated tokens are not in their row's TopK ∪ {{k}}; first: sample {sample}, position {position}). "
            "pdmctl carries top-K for single-turn agent loops only"
        )
