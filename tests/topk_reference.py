"""The per-token loop `topk.extract_topk` was before it was vectorised (commit 49e0c0d), kept as the
reference the vectorised version is tested against (tests/test_verl_topk.py) and timed against
(bench/topk.py); and vLLM-shaped rollout outputs for both."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pdmctl.backends.verl.topk import RolloutTopK, VllmLogprob


@dataclass
class Logprob:  # the fields of vllm.sequence.Logprob
    logprob: float
    rank: int | None
    decoded_token: str | None = None


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
    token (first in the dict, as vLLM puts it; with its own rank > k when outside the top-k)."""
    tokens: list[int] = []
    positions: list[dict[int, Logprob]] = []
    for _ in range(length):
        top_ids = rng.sample(range(vocab), k + 1)
        lps = sorted((-rng.expovariate(0.5) for _ in range(k + 1)), reverse=True)
        if rng.random() < p_outside:
            sampled, rank, lp = top_ids[k], rng.randint(k + 1, 5 * k), lps[k] - rng.expovariate(1.0)
        else:
            slot = rng.randrange(k)
            sampled, rank, lp = top_ids[slot], slot + 1, lps[slot]
        entries = {sampled: Logprob(lp, rank)}
        for slot in range(k):
            entries.setdefault(top_ids[slot], Logprob(lps[slot], slot + 1))
        tokens.append(sampled)
        positions.append(entries)
    return tokens, positions
