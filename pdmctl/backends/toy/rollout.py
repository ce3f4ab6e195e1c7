"""The rollout engine: its own copy of the weights, in the run's precision.

Like vLLM/SGLang it hands the trainer, per generated token, only the sampled
id, its log-probability and the top-K ids and log-probabilities, never the
full distribution: that is all the masks may know of μ.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from pdmctl.backends.toy.model import TinyTransformer, WeightCast
from pdmctl.backends.toy.task import MAX_RESPONSE_LEN


@dataclass(frozen=True)
class Rollout:
    """What the engine returns for a batch of prompts."""

    prompts: torch.Tensor  # long [B, P]
    sampled_ids: torch.Tensor  # long [B, T]
    sampled_logprobs: torch.Tensor  # float [B, T]: log μ_k
    topk_ids: torch.Tensor  # long [B, T, K]
    topk_logprobs: torch.Tensor  # float [B, T, K]: log μ_i on the top-K

    def select(self, rows: torch.Tensor) -> Rollout:
        """The rollout of the given rows (a mini-batch)."""
        return Rollout(*(getattr(self, f.name)[rows] for f in dataclasses.fields(self)))

    @property
    def tokens(self) -> torch.Tensor:
        """long [B, P + T]: the full sequences, as the trainer feeds them back."""
        return torch.cat([self.prompts, self.sampled_ids], dim=1)


class RolloutEngine:
    def __init__(
        self,
        policy: TinyTransformer,
        cast: WeightCast,
        k: int,
        max_len: int = MAX_RESPONSE_LEN,
        kv_cache: bool = False,
    ) -> None:
        self.model = copy.deepcopy(policy).requires_grad_(False)
        self.cast = cast
        self.k = k
        self.max_len = max_len  # tokens generated per prompt: the task's longest response
        self.kv_cache = kv_cache  # keep the prefix's keys and values (long responses) instead of recomputing

    @torch.no_grad()
    def sync(self, policy: TinyTransformer) -> None:
        """Load the policy's current weights, cast to the rollout precision (a weight sync)."""
        for mine, theirs in zip(self.model.parameters(), policy.parameters(), strict=True):
            mine.copy_(self.cast(theirs.detach()))

    def generate(self, prompts: torch.Tensor, generator: torch.Generator) -> Rollout:
        """Sample `max_len` tokens per prompt at temperature 1.0.

        Every row runs the full length (rows past EOS keep sampling; the
        response mask drops those tokens) so the batch stays one tensor. The
        sequences are a dozen tokens long, so the forward is recomputed over
        the whole prefix at each step: cheaper here than a KV cache's bookkeeping.
        """
        with torch.inference_mode():
            tokens = prompts
            sampled, sampled_lp, topk_ids, topk_lp = [], [], [], []
            cache, new = None, prompts
            for _ in range(self.max_len):
                if self.kv_cache:
                    logits, cache = self.model.cached(new, tokens.shape[1] - new.shape[1], cache)
                else:
                    logits = self.model(tokens)[:, -1]
                log_mu = torch.log_softmax(logits.float(), dim=-1)
                ids = sample(log_mu.exp(), generator)
                top = log_mu.topk(self.k, dim=-1)
                sampled.append(ids.squeeze(1))
                sampled_lp.append(log_mu.gather(1, ids).squeeze(1))
                topk_ids.append(top.indices)
                topk_lp.append(top.values)
                tokens, new = torch.cat([tokens, ids], dim=1), ids
        # clone out of inference mode: the trainer's autograd must be able to save these
        return Rollout(
            prompts=prompts.clone(),
            sampled_ids=torch.stack(sampled, 1).clone(),
            sampled_logprobs=torch.stack(sampled_lp, 1).clone(),
            topk_ids=torch.stack(topk_ids, 1).clone(),
            topk_logprobs=torch.stack(topk_lp, 1).clone(),
        )


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id per row of probs [B, V], long [B, 1], by inverting the cumulative distribution at a
    uniform draw: what torch.multinomial does, at a fraction of its cost over a 4,096-token vocabulary
    on CPU (it was a quarter of a training step). The draws come from `generator` (the run's, on CPU)
    whatever the device of `probs`, so a run on a GPU draws the same uniforms."""
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=cdf.dtype).to(cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_max(probs.shape[-1] - 1)
