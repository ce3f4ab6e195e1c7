"""The counterfactual on a VeRL run's snapshot, and what `pdmctl analyze --engine verl` prints.

On each snapshotted update (one of step N's mini-batches; the updates play the part of the testbed's seeds in
the intervals), at the start weights: every response token's D, Ḋ (the `exact` estimator, the primary
metric's) and r against the rollout's μ. Outside the region (D > δ) the ratio criterion keeps a token when
A(r − 1) ≤ 0, the predictive one when A·Ḋ ≤ 0; they disagree on some. For each criterion and each
disagreement token, two real updates from the snapshot (the replay's loss, clip_grad_norm_ and AdamW from the
carried state, replay.py), every other token as the criterion decides: one with the token kept and one with
it masked, own = D_j(keep) − D_j(mask), the direct way (a loss, a backward and an optimizer step each). The
clip-held pair scales the other member's gradient by the criterion's own update's clip factor. The whole
counterfactual runs in float32 and again in float64: the signs are compared above the floor float32 rounding
reaches (twice the largest |D(float32) − D(float64)| after the criteria's own updates).

Realized: ΔD of each token across VeRL's own update (the snapshot's weights after minus before), the
regime's unsafe-keep rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pdmctl.analysis.engine.replay import Replay, ReplayCheck, check_replay

ESTIMATOR = "exact"  # the primary metric's (inference.PRIMARY_ESTIMATOR)
CRITERIA = ("ratio", "predictive")
# out-of-region tokens per update whose pairs are taken beside the disagreement tokens (all where fewer): the
# float64 check and the out-of-region sample's line read them
SAMPLE = 4


@dataclass
class UpdateEffects:
    """One snapshotted update's tokens and counterfactual (flat over its response tokens)."""

    index: int
    tokens: int
    out_of_region: torch.Tensor  # bool [N]
    disagree: torch.Tensor  # bool [N]
    keeps: dict[str, torch.Tensor]  # criterion -> bool [N] (its keep on the out-of-region tokens)
    realized: torch.Tensor  # float64 [N]: D after VeRL's update − D before
    pairs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # the tokens of `own`
    own: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # (criterion, precision) -> [pairs]
    own_held: dict[str, torch.Tensor] = field(default_factory=dict)  # criterion -> [pairs] (float32)
    floor: float = math.nan
    check: ReplayCheck | None = None
    run: str = ""  # the run's directory name


def criteria_keeps(replay: Replay, precision: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(out_of_region, disagree, {criterion: keep}) over the response tokens at the start weights."""
    logits = replay.logits(replay.weights("weights_before", torch.float64 if precision == "float64" else torch.float32),
                           precision)  # fmt: skip
    d = replay.diagnostics(logits, method="pdm", estimator=ESTIMATOR)
    out = torch.cat([x.out_of_region for x in d])
    adv = torch.cat([x.advantages.double() for x in replay.samples])
    ratio = torch.cat([x.ratio.double() for x in d])
    ddot = torch.cat([x.ddot.double() for x in d])
    keeps = {"ratio": ~out | (adv * (ratio - 1) <= 0), "predictive": ~out | (adv * ddot <= 0)}
    return out, keeps["ratio"] != keeps["predictive"], keeps


def _split(flat: torch.Tensor, replay: Replay) -> list[torch.Tensor]:
    return list(flat.split([len(x.sampled_ids) for x in replay.samples]))


def counterfactual(replay: Replay, keep: torch.Tensor, tokens: torch.Tensor, precision: str):
    """own [n] (and own with the clip held [n]) for the listed tokens under the criterion's mask `keep` [N],
    and the D after the criterion's own update [N]."""
    grads = replay.gradient(_split(keep, replay), precision)
    theta, _ = replay.step(grads)
    factor = replay.clip_factor(grads)
    d_base = replay.divergence(theta, precision)
    own = torch.zeros(len(tokens), dtype=torch.float64)
    held = torch.zeros(len(tokens), dtype=torch.float64)
    for i, j in enumerate(tokens.tolist()):
        flipped = keep.clone()
        flipped[j] = ~flipped[j]
        g = replay.gradient(_split(flipped, replay), precision)
        sign = -1.0 if bool(keep[j]) else 1.0  # the other member: the kept token masked, the masked one kept
        own[i] = sign * float(replay.divergence(replay.step(g)[0], precision)[j] - d_base[j])
        held[i] = sign * float(replay.divergence(replay.step(g, clip_factor=factor)[0], precision)[j] - d_base[j])
    return own, held, d_base


def analyse_update(replay: Replay, index: int, check: bool = True) -> UpdateEffects:
    out, disagree, keeps = criteria_keeps(replay, "float32")
    before = replay.divergence(replay.weights("weights_before"), "float32")
    after = replay.divergence(replay.weights("weights_after"), "float32")
    found = UpdateEffects(index, replay.tokens, out, disagree, keeps, after - before)
    others = (out & ~disagree).nonzero().squeeze(1)
    drawn = others[torch.randperm(len(others), generator=torch.Generator().manual_seed(index))[:SAMPLE]]
    tokens = torch.cat([disagree.nonzero().squeeze(1), drawn.sort().values])
    found.pairs = tokens
    errors = [0.0]
    done: dict[bytes, tuple] = {}  # criteria with the same mask on the batch take the same updates
    for criterion in CRITERIA:
        keep = keeps[criterion]
        key = keep.numpy().tobytes()
        if key not in done:
            done[key] = (*counterfactual(replay, keep, tokens, "float32"), *counterfactual(replay, keep, tokens, "float64"))
        own32, held32, base32, own64, _, base64 = done[key]
        found.own[criterion, "float32"], found.own[criterion, "float64"] = own32, own64
        found.own_held[criterion] = held32
        errors.append(float((base32 - base64)[out].abs().max()) if bool(out.any()) else 0.0)
    found.floor = 2 * max(errors)
    found.check = check_replay(replay) if check else None
    return found


@dataclass(frozen=True)
class SignCheck:
    pairs: int  # (criterion, token) own effects compared
    above: int  # of them with |own (float64)| above the floor
    agree: int  # of those, the float32 sign is the float64 one
    floor: float  # the largest floor of the updates


def sign_check(updates: list[UpdateEffects]) -> SignCheck:
    pairs = above = agree = 0
    for u in updates:
        for criterion in CRITERIA:
            a, b = u.own[criterion, "float32"], u.own[criterion, "float64"]
            big = b.abs() > u.floor
            pairs += len(a)
            above += int(big.sum())
            agree += int(((a > 0) == (b > 0))[big].sum())
    return SignCheck(pairs, above, agree, max((u.floor for u in updates), default=0.0))


def primary_counts(updates: list[UpdateEffects], held: bool = False):
    """(unsafe predictive, kept predictive, unsafe ratio, kept ratio) per update on the disagreement tokens each
    criterion keeps (float32's own effects; clip-held ones with `held`)."""
    counts: dict[str, tuple[list[int], list[int]]] = {c: ([], []) for c in CRITERIA}
    for u in updates:
        for c in CRITERIA:
            kept = u.keeps[c][u.pairs] & u.disagree[u.pairs]
            own = u.own_held[c] if held else u.own[c, "float32"]
            counts[c][0].append(int((own[kept] > 0).sum()))
            counts[c][1].append(int(kept.sum()))
    return (*counts["predictive"], *counts["ratio"])


def realized_rates(updates: list[UpdateEffects]) -> dict[str, tuple[float | None, float | None]]:
    """criterion -> (mean over updates, pooled) of the realized unsafe-keep rate on its kept disagreement tokens."""
    found = {}
    for c in CRITERIA:
        ups, ns = [], []
        for u in updates:
            kept = u.disagree & u.keeps[c]
            ups.append(int((u.realized[kept] > 0).sum()))
            ns.append(int(kept.sum()))
        rates = [a / n for a, n in zip(ups, ns, strict=True) if n]
        found[c] = (sum(rates) / len(rates) if rates else None, sum(ups) / sum(ns) if sum(ns) else None)
    return found


def sample_counts(updates: list[UpdateEffects]) -> dict[str, tuple[int, int, int, int]]:
    """criterion -> (kept, of them own > 0, masked, of them own < 0) on the out-of-region sample (float32)."""
    found = {}
    for c in CRITERIA:
        kept = up = masked = down = 0
        for u in updates:
            sample = ~u.disagree[u.pairs]
            k = u.keeps[c][u.pairs] & sample
            own = u.own[c, "float32"]
            kept, up = kept + int(k.sum()), up + int((own[k] > 0).sum())
            m = ~u.keeps[c][u.pairs] & sample
            masked, down = masked + int(m.sum()), down + int((own[m] < 0).sum())
        found[c] = (kept, up, masked, down)
    return found
