"""What the testbed's tails look like and what they change: the figures `bench/testbed.py --tails` prints.

Two measurements, both on the default preset unless told otherwise:

- `tail_profile`: for every response token a policy samples on the held-out
  sets, the mass of its top-K tokens (K = 5, 10, 20, 50) and its entropy,
  summarised over positions as quantiles (DPPO reports top-20 holding 99.4% of
  an LLM's mass on average);
- `k_and_estimator_effects`: on stale rollout batches (the direction
  analysis's, `probe.stale_batch`), how much K and the tail estimator
  change D, the keep decisions and the sign of Ḋ on the out-of-region tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdmctl.backends.toy import task
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import PRECISIONS, TinyTransformer
from pdmctl.backends.toy.probe import diagnostics, stale_batch
from pdmctl.backends.toy.rollout import Rollout, RolloutEngine

PROFILE_KS = (5, 10, 20, 50)
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
DPPO_TOP20_MEAN = 0.994  # DPPO's measurement on an LLM: top-20 holds 99.4% of the mass on average


@dataclass(frozen=True)
class TailProfile:
    """Per response token: top-K masses (one row per K in PROFILE_KS) and entropies (nats)."""

    topk_mass: dict[int, list[float]]  # K -> quantiles (QUANTILES) over tokens
    topk_mass_mean: dict[int, float]
    entropy: list[float]  # quantiles
    entropy_mean: float
    tokens: int
    high_entropy_share: float  # tokens with entropy > 1 nat
    top20_by_position: list[float]  # mean top-20 mass at each response position


def tail_profile(policy: TinyTransformer, precision: str = "bf16", samples: int = 16) -> TailProfile:
    """The rollout engine's distributions on every token it samples for the held-out sets."""
    engine = RolloutEngine(policy, PRECISIONS[precision].rollout, 1)
    engine.sync(policy)
    generator = torch.Generator().manual_seed(0)
    log_mu, response = [], []
    for name in ("toy24", "toy25"):
        prompts = task.heldout(name).repeat(samples).prompts
        rollout = engine.generate(prompts, generator)
        with torch.no_grad():
            logits = engine.model(rollout.tokens[:, :-1], last=task.MAX_RESPONSE_LEN)
        log_mu.append(torch.log_softmax(logits.float(), -1))
        response.append(task.response_mask(rollout.sampled_ids).bool())
    lp, mask = torch.cat(log_mu), torch.cat(response)
    probs = lp.exp()
    entropy = -(probs * lp).sum(-1)
    top = probs.topk(max(PROFILE_KS), -1).values.cumsum(-1)
    q = torch.tensor(QUANTILES)
    masses = {k: top[..., k - 1][mask] for k in PROFILE_KS}
    return TailProfile(
        topk_mass={k: torch.quantile(v, q).tolist() for k, v in masses.items()},
        topk_mass_mean={k: float(v.mean()) for k, v in masses.items()},
        entropy=torch.quantile(entropy[mask], q).tolist(),
        entropy_mean=float(entropy[mask].mean()),
        tokens=int(mask.sum()),
        high_entropy_share=float((entropy[mask] > 1.0).float().mean()),
        top20_by_position=[float(top[:, p, 19][mask[:, p]].mean()) for p in range(task.MAX_RESPONSE_LEN)],
    )


@dataclass(frozen=True)
class Effects:
    """What K and the estimator change on the out-of-region tokens (D > δ with K = 50), pooled over seeds."""

    seeds: int
    out_of_region: int
    mean_d: dict[int, float]  # K -> mean D over those tokens
    keep_differs_k: float  # share whose PDM (agg) keep decision differs between K = 10 and K = 50
    sign_differs: dict[str, float]  # "agg/uni", "agg/exact", "uni/exact" -> share with sign(Ḋ) differing

    @property
    def mean_d_change(self) -> float:
        """|mean D(K=10) − mean D(K=50)| / mean D(K=50)."""
        return abs(self.mean_d[10] - self.mean_d[50]) / self.mean_d[50]


def _first_k(batch: Rollout, k: int) -> Rollout:
    """The rollout as an engine handing over only its top k would have returned it (top-K is sorted)."""
    return dataclasses.replace(
        batch, topk_ids=batch.topk_ids[..., :k].contiguous(), topk_logprobs=batch.topk_logprobs[..., :k].contiguous()
    )


def k_and_estimator_effects(cfg: ToyConfig, seeds: list[int], ks: tuple[int, int] = (10, 50)) -> Effects:
    small, large = ks
    out_total = 0
    d_sum = {small: 0.0, large: 0.0}
    keep_differs = 0
    pairs = (("agg", "uni"), ("agg", "exact"), ("uni", "exact"))
    sign_differs = dict.fromkeys(pairs, 0)
    for seed in seeds:
        run = dataclasses.replace(cfg, seed=seed, k=large)
        learner, batch, advantages = stale_batch(run)
        response = task.response_mask(batch.sampled_ids).bool()
        d = {
            k: {e: diagnostics(learner, _first_k(batch, k), advantages, run, e) for e in ("agg", "uni", "exact")}
            for k in ks
        }
        out = d[large]["agg"].out_of_region & response
        out_total += int(out.sum())
        for k in ks:
            d_sum[k] += float(d[k]["agg"].divergence[out].sum())
        keep_differs += int((d[small]["agg"].keep != d[large]["agg"].keep)[out].sum())
        for a, b in pairs:
            sign_differs[(a, b)] += int(((d[large][a].ddot > 0) != (d[large][b].ddot > 0))[out].sum())
    n = max(out_total, 1)
    return Effects(
        seeds=len(seeds),
        out_of_region=out_total,
        mean_d={k: v / n for k, v in d_sum.items()},
        keep_differs_k=keep_differs / n,
        sign_differs={f"{a}/{b}": v / n for (a, b), v in sign_differs.items()},
    )
