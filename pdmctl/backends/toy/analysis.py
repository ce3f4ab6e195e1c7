"""The token-level direction analysis (MATH.md, "The token-level direction analysis"; paper §4.2).

Per seed: a fresh rollout batch from the base model, made stale as in
training (all mini-batch updates of the step but the last), then, at those
weights, every response token's D, Ḋ and r against the rollout's μ. For the
tokens outside the region (D > δ) the ratio criterion keeps a token when
A(r − 1) ≤ 0, the predictive one when A·Ḋ ≤ 0; they disagree on a few. Each
criterion then takes one real update on the whole batch from the same weights
and optimizer state, and D is recomputed on the same tokens: ΔD > 0 on a kept
disagreement token is an unsafe keep, ΔD < 0 a corrective one.

How the update is taken is a protocol (`PROTOCOLS`): with the Adam state the
stale mini-batch updates left (`carried`, the default: the paper's "one actual
update on the same batch" is the step training takes next), with a fresh Adam
(`fresh-adam`), or as a plain gradient step (`sgd`). The verdict can depend on
it (issue 19: carried momentum is most of ΔD), so the others are measured and
printed beside the default.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass

import torch
from rich.table import Table

from pdmctl import masks
from pdmctl.backends.toy import decomposition, task
from pdmctl.backends.toy.bands import BandCounter, BandStats, topk_mass
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import PRECISIONS, forward
from pdmctl.backends.toy.rollout import Rollout
from pdmctl.backends.toy.trainer import Learner, grpo_advantages, masked_loss

ESTIMATORS = ("agg", "uni", "exact")
PROTOCOLS = {  # how the update that ΔD measures is taken, from the same weights
    "carried": "Adam with the state the stale mini-batch updates left (the step training takes next)",
    "fresh-adam": "a fresh Adam: the first step of a run, no momentum",
    "sgd": "the plain (clipped) gradient, no preconditioning, scaled to the fresh Adam step's length",
    "own-adam": "first order, the token's own gradient alone through the carried Adam step's gain",
    "own-grad": "first order, the token's own gradient alone as a plain gradient step",
}
UPDATE_PROTOCOLS = ("carried", "fresh-adam", "sgd")  # the protocols that take a real update
DEFAULT_PROTOCOLS = ("carried", "fresh-adam", "sgd", "own-adam", "own-grad")  # the first is the main table's


@dataclass(frozen=True)
class CriterionStats:
    """One direction criterion on one estimator's disagreement tokens."""

    unsafe_keep_per_seed: list[float | None]  # None where the criterion kept no disagreement token
    unsafe_keep_mean: float | None  # None where no seed has a rate (and the s.e. where fewer than two)
    unsafe_keep_se: float | None
    corrective_pooled: float | None  # ΔD < 0 among the kept disagreement tokens of all seeds together
    kept_pooled: int
    corrective_per_seed: list[float | None]  # ΔD < 0 among each seed's kept disagreement tokens
    kept_per_seed: list[int] = dataclasses.field(default_factory=list)  # kept disagreement tokens


@dataclass(frozen=True)
class EstimatorDifference:
    """The predictive criterion with one estimator minus with another, paired by seed: the mean of the
    per-seed differences and its Student's t interval (report.stats.paired_difference)."""

    measure: str  # "unsafe-keep" or "corrective"
    first: str  # estimator
    second: str
    mean: float | None  # None where no seed has both rates
    low: float | None  # None below two seeds
    high: float | None
    seeds: int  # seeds where both rates exist


@dataclass(frozen=True)
class Comparison:
    """Ratio direction vs the predictive direction with one tail estimator, on their disagreement set."""

    estimator: str
    disagreement_per_seed: list[int]
    ratio: CriterionStats
    predictive: CriterionStats
    predictive_wins: int  # seeds where the predictive unsafe-keep rate is lower
    ratio_wins: int
    seeds_compared: int  # seeds where both rates exist


@dataclass(frozen=True)
class DecompositionRow:
    """ΔD of one criterion's update under one protocol, over the out-of-region tokens with A ≠ 0 that the
    criterion keeps (all seeds pooled): the first-order ΔD = own + others + momentum. A share is
    |piece| / (|own| + |others| + |momentum|), per token, then the median; a sign agreement is the share of
    tokens whose piece has the sign of the realized ΔD (None where the piece is zero: no momentum)."""

    protocol: str
    criterion: str  # "ratio" or "predictive/<estimator>"
    tokens: int
    own_share: float | None
    others_share: float | None
    momentum_share: float | None
    first_order_sign: float | None  # sign(first-order ΔD) = sign(realized ΔD)
    own_sign: float | None
    others_sign: float | None
    momentum_sign: float | None
    own_logit_sign: float | None  # the own effect as the criterion assumes it: along e_k − π in logit space
    own_last_layer_share: float | None  # median |head's part| / (|head's part| + |the rest's|) of own
    first_order_error: float | None  # median |realized − first order| / |realized|
    own_share_per_seed: list[float | None] = dataclasses.field(default_factory=list)
    others_share_per_seed: list[float | None] = dataclasses.field(default_factory=list)
    momentum_share_per_seed: list[float | None] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class AssumptionRow:
    """One way of taking a token's own effect on its D, against the two criteria's predictions of its sign,
    over the out-of-region tokens with A ≠ 0 of all seeds (each token's own gradient as if kept)."""

    own_effect: str
    tokens: int
    agrees_exact: float | None  # share with sign(own effect) = sign(A·Ḋ_exact)
    agrees_ratio: float | None  # share with sign(own effect) = sign(A(r − 1))
    last_layer_share: float | None  # median |head's part| / (|head's part| + |the rest's|)


@dataclass(frozen=True)
class DisagreementTokens:
    """Every disagreement token of one estimator, seeds pooled (the figures' data: figures.py). Token i is
    at response position `position[i]` of seed `seeds[seed[i]]`; `predictive_keeps[i]`: the predictive
    criterion keeps it and the ratio one masks it (else the other way round); `delta_d[p][i]`: its ΔD
    after the update of the criterion that keeps it, under protocol p."""

    estimator: str
    seed: list[int]
    position: list[int]
    advantage: list[float]
    predictive_keeps: list[bool]
    delta_d: dict[str, list[float]]


@dataclass(frozen=True)
class AnalysisResult:
    seeds: list[int]
    delta: float
    k: int
    divergence: str
    precision: str
    tokens_per_seed: list[int]  # response tokens
    out_of_region_per_seed: list[int]
    comparisons: list[Comparison]  # under `protocol`
    estimator_differences: list[EstimatorDifference]
    level: float = 0.95
    protocol: str = "carried"  # how the update that ΔD measures was taken (PROTOCOLS)
    # every protocol measured, the main one included: protocol -> one Comparison per estimator
    protocol_comparisons: dict[str, list[Comparison]] = dataclasses.field(default_factory=dict)
    # ΔD decomposed (decomposition.py): one row per update protocol and criterion
    decomposition: list[DecompositionRow] = dataclasses.field(default_factory=list)
    # the predictive criterion's logit-space assumption against the whole network's own effect
    logit_assumption: list[AssumptionRow] = dataclasses.field(default_factory=list)
    bands: list[BandStats] = dataclasses.field(default_factory=list)  # by top-K mass (bands.py)
    # "stale": the step's other mini-batch updates first (training's staleness); "mismatch-only": the
    # fresh rollout, D from the rollout weights' precision alone (the paper's §4.2 setting)
    setting: str = "stale"
    tokens_per_position: list[int] = dataclasses.field(default_factory=list)  # response tokens, seeds pooled
    out_of_region_per_position: list[int] = dataclasses.field(default_factory=list)
    disagreement_tokens: list[DisagreementTokens] = dataclasses.field(default_factory=list)  # per estimator

    def to_json(self) -> str:
        """The whole result; one line per field, the token lists each on one line (they are most of it)."""
        data = dataclasses.asdict(self)
        lines = [f"  {json.dumps(k)}: {json.dumps(v, allow_nan=False, ensure_ascii=False)}" for k, v in data.items()]
        return "{\n" + ",\n".join(lines) + "\n}\n"


@dataclass(frozen=True)
class _SeedTokens:
    """One seed's disagreement tokens for one estimator: who keeps them and ΔD under each update."""

    ratio_kept_delta_d: torch.Tensor
    predictive_kept_delta_d: torch.Tensor
    disagreements: int


def default_jobs() -> int:
    """The processes `run_analysis` spreads seeds over by default: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_analysis(
    cfg: ToyConfig,
    seeds: list[int],
    protocols: tuple[str, ...] = ("carried",),
    *,
    jobs: int = 1,
    threads: int | None = 1,
    reference: bool = False,
    mismatch_only: bool = False,
) -> AnalysisResult:
    """The direction analysis on `seeds` (each a fresh rollout batch) with the config's mask settings, ΔD
    measured under each of `protocols` (the first is the main table's).

    `jobs` > 1 analyses the seeds in that many worker processes (spawned), `threads` torch threads each
    (default 1, whatever the machine: a seed's numbers depend on `threads`, the order of float sums, not
    on `jobs` or on which worker ran it, tests/test_toy_analysis.py). With `jobs` = 1 the seeds run here,
    under `threads` torch threads (None: this process's setting). `reference` takes every update and every per-token gradient
    the direct way (one Learner.update per criterion and protocol, whole-network jacobians): the slow
    code the fast one is tested against. `mismatch_only`: the paper's fresh-rollout setting, no stale
    mini-batch update before the criteria's (D from the rollout weights' precision alone; with it the
    `carried` protocol's Adam has no state)."""
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        raise ValueError(f"protocols: unknown {unknown or 'none given'}; choose from {sorted(PROTOCOLS)}")
    if jobs < 1 or (threads is not None and threads < 1):
        raise ValueError(f"jobs and threads: must be >= 1, got {jobs} and {threads}")
    tasks = [(dataclasses.replace(cfg, seed=seed), tuple(protocols), reference, not mismatch_only) for seed in seeds]
    if jobs == 1 or len(seeds) == 1:
        before = torch.get_num_threads()
        try:
            if threads is not None:
                torch.set_num_threads(threads)
            results = [_seed_task(t) for t in tasks]
        finally:
            torch.set_num_threads(before)
    else:
        import functools
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from pdmctl.lifetime import end_with_parent

        per_job = threads or 1
        with ProcessPoolExecutor(
            max_workers=min(jobs, len(seeds)),
            mp_context=multiprocessing.get_context("spawn"),  # no forked OpenMP pools, the same on every OS
            # first thing in a worker, before it imports torch: a killed `pdmctl analyze` leaves none behind
            initializer=end_with_parent,
            initargs=(os.getpid(),),
        ) as pool:
            results = list(pool.map(functools.partial(_threads_then_seed_task, per_job), tasks))
    return _combine(cfg, list(seeds), tuple(protocols), results, "mismatch-only" if mismatch_only else "stale")


@dataclass(frozen=True)
class _SeedResult:
    tokens: int  # response tokens
    out_of_region: int
    by_protocol: dict[str, dict[str, _SeedTokens]]
    parts: _SeedDecomposition
    bands: BandCounter
    extras: _SeedExtras


def _threads_then_seed_task(threads: int, task: tuple[ToyConfig, tuple[str, ...], bool, bool]) -> _SeedResult:
    torch.set_num_threads(threads)
    return _seed_task(task)


def _seed_task(task: tuple[ToyConfig, tuple[str, ...], bool, bool]) -> _SeedResult:
    cfg, protocols, reference, stale = task
    bands, extras = BandCounter.empty(), _SeedExtras()
    n_tokens, n_out, by_protocol, parts = _analyse_seed(
        cfg, protocols, bands, reference=reference, stale=stale, extras=extras
    )
    return _SeedResult(n_tokens, n_out, by_protocol, parts, bands, extras)


def _combine(
    cfg: ToyConfig, seeds: list[int], protocols: tuple[str, ...], results: list[_SeedResult], setting: str
) -> AnalysisResult:
    bands = BandCounter.empty()
    for r in results:
        bands.merge(r.bands)
    per_seed = [r.by_protocol for r in results]
    decomposed = [r.parts for r in results]
    by_protocol = {p: [_compare(e, [s[p][e] for s in per_seed]) for e in ESTIMATORS] for p in protocols}
    comparisons = by_protocol[protocols[0]]
    return AnalysisResult(
        seeds=list(seeds),
        delta=cfg.delta,
        k=cfg.k,
        divergence=cfg.divergence,
        precision=cfg.precision,
        tokens_per_seed=[r.tokens for r in results],
        out_of_region_per_seed=[r.out_of_region for r in results],
        comparisons=comparisons,
        estimator_differences=_estimator_differences(comparisons),
        protocol=protocols[0],
        protocol_comparisons=by_protocol,
        decomposition=_decomposition_rows(decomposed),
        logit_assumption=_assumption_rows(decomposed),
        bands=bands.stats(),
        setting=setting,
        tokens_per_position=_add_lists([r.extras.tokens_per_position for r in results]),
        out_of_region_per_position=_add_lists([r.extras.out_of_region_per_position for r in results]),
        disagreement_tokens=[
            DisagreementTokens(
                estimator=e,
                seed=[i for i, r in enumerate(results) for _ in r.extras.tokens[e]["position"]],
                position=[x for r in results for x in r.extras.tokens[e]["position"]],
                advantage=[_g7(x) for r in results for x in r.extras.tokens[e]["advantage"]],
                predictive_keeps=[x for r in results for x in r.extras.tokens[e]["predictive_keeps"]],
                delta_d={p: [_g7(x) for r in results for x in r.extras.tokens[e]["delta_d"][p]] for p in protocols},
            )
            for e in ESTIMATORS
        ],
    )


def _g7(x: float) -> float:
    """7 significant digits (float32's): the JSON carries every disagreement token, so it stays small."""
    return float(f"{x:.7g}")


def _add_lists(lists: list[list[int]]) -> list[int]:
    return [sum(column) for column in zip(*lists, strict=True)] if lists else []


ESTIMATOR_PAIRS = (("uni", "agg"), ("exact", "agg"), ("exact", "uni"))


def _estimator_differences(comparisons: list[Comparison], level: float = 0.95) -> list[EstimatorDifference]:
    from pdmctl.report.stats import paired_difference

    by_estimator = {c.estimator: c.predictive for c in comparisons}
    found = []
    for measure, field in (("unsafe-keep", "unsafe_keep_per_seed"), ("corrective", "corrective_per_seed")):
        for first, second in ESTIMATOR_PAIRS:
            pairs = [
                (a, b)
                for a, b in zip(
                    getattr(by_estimator[first], field), getattr(by_estimator[second], field), strict=True
                )
                if a is not None and b is not None
            ]
            estimate = (
                paired_difference([a for a, _ in pairs], [b for _, b in pairs], level) if pairs else None
            )
            interval = estimate.interval if estimate is not None else None
            found.append(
                EstimatorDifference(
                    measure=measure,
                    first=first,
                    second=second,
                    mean=estimate.mean if estimate is not None else None,
                    low=interval.low if interval is not None else None,
                    high=interval.high if interval is not None else None,
                    seeds=len(pairs),
                )
            )
    return found


def stale_batch(cfg: ToyConfig, *, stale: bool = True) -> tuple[Learner, Rollout, torch.Tensor]:
    """A fresh rollout batch from the base model and its advantages, with the learner moved on by all
    mini-batch updates of the step but the last: the staleness of a step's last mini-batch. With
    `stale` False the learner stays at the rollout's weights (no update, a fresh Adam): the fresh
    rollout, where D comes from the rollout weights' precision alone."""
    learner = Learner.from_base(cfg)
    problems = learner.task.sample_train(cfg.prompts_per_step, learner.generator).repeat(cfg.group_size)
    batch = learner.rollout(problems)
    advantages = grpo_advantages(learner.task.score(problems, batch.sampled_ids), cfg.group_size)
    order = torch.randperm(len(problems), generator=learner.generator)
    for rows in order.tensor_split(cfg.minibatches)[:-1] if stale else ():
        learner.update(batch.select(rows), advantages[rows], cfg)
    return learner, batch, advantages


@dataclass
class _SeedExtras:
    """What one seed adds to the figures' data (filled by _analyse_seed)."""

    tokens_per_position: list[int] = dataclasses.field(default_factory=list)
    out_of_region_per_position: list[int] = dataclasses.field(default_factory=list)
    tokens: dict[str, dict[str, list]] = dataclasses.field(default_factory=dict)  # estimator -> field -> values


def _analyse_seed(
    cfg: ToyConfig,
    protocols: tuple[str, ...],
    bands: BandCounter | None = None,
    *,
    reference: bool = False,
    stale: bool = True,
    extras: _SeedExtras | None = None,
) -> tuple[int, int, dict[str, dict[str, _SeedTokens]], _SeedDecomposition]:
    learner, batch, advantages = stale_batch(cfg, stale=stale)
    response = task.response_mask(batch.sampled_ids).bool()
    pre = {e: diagnostics(learner, batch, advantages, cfg, e) for e in ESTIMATORS}
    if bands is not None:  # the same stale batch and diagnostics as the tables (bands.band_analysis's)
        bands.add(topk_mass(batch.topk_logprobs), learner.task.response_mask(batch.sampled_ids).bool(),
                  pre["agg"].out_of_region, {e: v.ddot for e, v in pre.items()}, pre["agg"].ratio)  # fmt: skip
    outside = pre["agg"].out_of_region & response
    ratio_keep = advantages.unsqueeze(1) * (pre["agg"].ratio - 1) <= 0
    start = snapshot(learner)
    params = list(learner.policy.parameters())
    theta0 = decomposition.flat(params)
    criteria = {"ratio": dataclasses.replace(cfg, method="dppo")} | {
        f"predictive/{e}": dataclasses.replace(cfg, method="pdm", estimator=e) for e in ESTIMATORS
    }
    updates = [p for p in protocols if p in UPDATE_PROTOCOLS]
    if "carried" not in updates and any(p not in UPDATE_PROTOCOLS for p in protocols):
        updates.append("carried")  # the own-effect protocols take the carried step's gain and clipping
    delta: dict[tuple[str, str], torch.Tensor] = {}
    parts: dict[tuple[str, str], decomposition.UpdateParts] = {}
    # ΔD is read on out-of-region tokens only: D after each update on the rows that hold one (NaN elsewhere)
    rows_out = outside.any(1).nonzero().squeeze(1)
    batch_out, advantages_out = batch.select(rows_out), advantages[rows_out]
    d_pre_out = diagnostics(learner, batch_out, advantages_out, cfg, "agg").divergence

    def delta_d() -> torch.Tensor:
        found = torch.full(outside.shape, math.nan)
        found[rows_out] = diagnostics(learner, batch_out, advantages_out, cfg, "agg").divergence - d_pre_out
        return found

    # every update starts from the same weights, so each criterion's clipped gradient is the same under
    # every protocol: one forward for all criteria, one backward each, then each protocol's optimizer step
    gradients = {} if reference else criterion_gradients(learner, batch, advantages, criteria)
    for protocol in updates:
        for name, criterion in criteria.items():
            if reference:
                metrics = take_update_reference(learner, start, batch, advantages, criterion, protocol)
            else:
                metrics = apply_update(learner, start, gradients[name], criterion, protocol)
            parts[protocol, name] = decomposition.update_parts(
                params, theta0, start.optimizer, criterion, protocol, metrics["grad_norm"]
            )
            delta[protocol, name] = delta_d()
    restore(learner, start)
    seed_parts = _decompose_seed(
        learner, cfg, batch, advantages, pre, outside, criteria, parts, delta, reference=reference
    )

    found: dict[str, dict[str, _SeedTokens]] = {}
    for protocol in protocols:
        delta_ratio = delta[protocol, "ratio"]
        found[protocol] = {}
        for e in ESTIMATORS:
            predictive_keep = advantages.unsqueeze(1) * pre[e].ddot <= 0
            disagree = outside & (ratio_keep != predictive_keep)
            delta_pred = delta[protocol, f"predictive/{e}"]
            found[protocol][e] = _SeedTokens(
                ratio_kept_delta_d=delta_ratio[disagree & ratio_keep],
                predictive_kept_delta_d=delta_pred[disagree & predictive_keep],
                disagreements=int(disagree.sum()),
            )
    if extras is not None:
        extras.tokens_per_position = response.sum(0).tolist()
        extras.out_of_region_per_position = outside.sum(0).tolist()
        a = advantages.unsqueeze(1).expand_as(outside)
        for e in ESTIMATORS:
            predictive_keep = a * pre[e].ddot <= 0
            disagree = outside & (ratio_keep != predictive_keep)
            rows, cols = disagree.nonzero(as_tuple=True)
            keeps = predictive_keep[rows, cols]
            extras.tokens[e] = {
                "position": cols.tolist(),
                "advantage": a[rows, cols].tolist(),
                "predictive_keeps": keeps.tolist(),
                "delta_d": {
                    p: torch.where(keeps, delta[p, f"predictive/{e}"][rows, cols].double(),
                                   delta[p, "ratio"][rows, cols].double()).tolist()
                    for p in protocols
                },  # fmt: skip
            }
    return int(response.sum()), int(outside.sum()), found, seed_parts


@dataclass(frozen=True)
class CriterionGradient:
    """One criterion's update direction at the start weights: the clipped gradient (per parameter) and
    the update's metrics (Learner.update's, with `grad_norm` before clipping)."""

    grads: list[torch.Tensor]
    metrics: dict[str, float]


def criterion_gradients(
    learner: Learner, batch: Rollout, advantages: torch.Tensor, criteria: dict[str, ToyConfig]
) -> dict[str, CriterionGradient]:
    """Each criterion's clipped gradient at the learner's current weights, as `Learner.update` computes it
    (the same forward, masks.policy_loss, backward and clipping, bit for bit), from one forward shared by
    the criteria: a criterion changes the loss's mask, not the logits. The weights are left as they were;
    the parameters' `.grad` holds the last criterion's gradient."""
    params = list(learner.policy.parameters())
    resp_mask = learner.task.response_mask(batch.sampled_ids)
    any_cfg = next(iter(criteria.values()))
    logits = forward(
        learner.policy, batch.tokens[:, :-1], learner.task.max_response_len, PRECISIONS[any_cfg.precision].train
    )
    found = {}
    names = list(criteria)
    for i, (name, cfg) in enumerate(criteria.items()):
        if cfg.precision != any_cfg.precision:
            raise ValueError("criterion_gradients: the criteria share one precision (one forward)")
        loss, metrics = masked_loss(logits, batch, advantages, resp_mask, cfg)
        learner.optimizer.zero_grad()
        loss.backward(retain_graph=i < len(names) - 1)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        found[name] = CriterionGradient(
            [p.grad.detach().clone() for p in params], {**metrics, "grad_norm": float(norm)}
        )
    return found


def apply_update(
    learner: Learner, start: Snapshot, gradient: CriterionGradient, criterion: ToyConfig, protocol: str
) -> dict[str, float]:
    """One update along `gradient` (criterion_gradients's, taken at `start`'s weights) from `start`, as
    `protocol` says; the gradient's metrics. The parameters' `.grad` holds the clipped gradient after."""
    params = list(learner.policy.parameters())

    def step(optimizer: torch.optim.Optimizer) -> None:
        for p, g in zip(params, gradient.grads, strict=True):
            p.grad = g.clone()
        optimizer.step()

    restore(learner, start)
    if protocol == "carried":
        step(learner.optimizer)
        return gradient.metrics
    step(torch.optim.Adam(params, lr=criterion.lr))
    if protocol == "fresh-adam":
        return gradient.metrics
    if protocol != "sgd":
        raise ValueError(f"protocol: {protocol!r} takes no update; choose from {UPDATE_PROTOCOLS}")
    # sgd: the clipped gradient itself (an SGD step of lr 1), rescaled to the fresh Adam step's length
    theta_adam = torch.nn.utils.parameters_to_vector(params).detach()
    restore(learner, start)
    theta = torch.nn.utils.parameters_to_vector(params).detach()
    step(torch.optim.SGD(params, lr=1.0))
    with torch.no_grad():
        delta = torch.nn.utils.parameters_to_vector(params) - theta
        norm = torch.linalg.vector_norm(delta)
        scale = torch.linalg.vector_norm(theta_adam - theta) / norm if norm > 0 else torch.ones(())
        torch.nn.utils.vector_to_parameters(theta + delta * scale, params)
    return gradient.metrics


def take_update(
    learner: Learner,
    start: Snapshot,
    batch: Rollout,
    advantages: torch.Tensor,
    criterion: ToyConfig,
    protocol: str,
) -> dict[str, float]:
    """One update with `criterion`'s mask on the whole batch from `start`, taken as `protocol` says; the
    metrics of the update that was kept (Learner.update's)."""
    restore(learner, start)
    gradient = criterion_gradients(learner, batch, advantages, {"criterion": criterion})["criterion"]
    return apply_update(learner, start, gradient, criterion, protocol)


def take_update_reference(
    learner: Learner,
    start: Snapshot,
    batch: Rollout,
    advantages: torch.Tensor,
    criterion: ToyConfig,
    protocol: str,
) -> dict[str, float]:
    """`take_update` the direct way, kept as its reference (`run_analysis(reference=True)`): a whole
    Learner.update (forward, loss, backward, step) per criterion and protocol."""
    restore(learner, start)
    if protocol == "carried":
        return learner.update(batch, advantages, criterion)
    params = list(learner.policy.parameters())
    fresh = dataclasses.replace(learner, optimizer=torch.optim.Adam(params, lr=criterion.lr))
    metrics = fresh.update(batch, advantages, criterion)
    if protocol == "fresh-adam":
        return metrics
    # sgd: the clipped gradient itself (an SGD step of lr 1), rescaled to the fresh Adam step's length
    theta_adam = torch.nn.utils.parameters_to_vector(params).detach()
    restore(learner, start)
    theta = torch.nn.utils.parameters_to_vector(params).detach()
    metrics = dataclasses.replace(learner, optimizer=torch.optim.SGD(params, lr=1.0)).update(
        batch, advantages, criterion
    )
    with torch.no_grad():
        step = torch.nn.utils.parameters_to_vector(params) - theta
        norm = torch.linalg.vector_norm(step)
        scale = torch.linalg.vector_norm(theta_adam - theta) / norm if norm > 0 else torch.ones(())
        torch.nn.utils.vector_to_parameters(theta + step * scale, params)
    return metrics


@dataclass(frozen=True)
class Snapshot:
    """The weights and the optimizer state every criterion's update starts from."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, object]


def snapshot(learner: Learner) -> Snapshot:
    return Snapshot(copy.deepcopy(learner.policy.state_dict()), copy.deepcopy(learner.optimizer.state_dict()))


def restore(learner: Learner, start: Snapshot) -> None:
    """Put the learner back to `start`, bit for bit, leaving `start` as it was.

    `Module.load_state_dict` copies into the parameters, but `Optimizer.load_state_dict` keeps the
    tensors it is given (same dtype and device) and Adam then updates them in place: restoring
    `start.optimizer` itself would let every update move the snapshot on (issue 19: the ratio update
    started at Adam step 7, the next criterion at step 8 with the ratio update in its momentum). So
    the optimizer gets a copy of the snapshot at each use."""
    learner.policy.load_state_dict(start.weights)
    learner.optimizer.load_state_dict(copy.deepcopy(start.optimizer))


def diagnostics(
    learner: Learner, batch: Rollout, advantages: torch.Tensor, cfg: ToyConfig, estimator: str
) -> masks.Diagnostics:
    """D, Ḋ and r of every generated token ([B, T] each) at the learner's current weights."""
    with torch.no_grad():
        logits = forward(
            learner.policy, batch.tokens[:, :-1], batch.sampled_ids.shape[1], PRECISIONS[cfg.precision].train
        )
    shape = batch.sampled_ids.shape
    d = decomposition.flat_diagnostics(logits, batch, advantages, cfg, method="pdm", estimator=estimator)
    return dataclasses.replace(d, **{f.name: getattr(d, f.name).view(shape) for f in dataclasses.fields(d)})


def _criterion(kept_delta_d: list[torch.Tensor]) -> CriterionStats:
    rates = [float((dd > 0).float().mean()) if dd.numel() else None for dd in kept_delta_d]
    defined = [r for r in rates if r is not None]
    mean = sum(defined) / len(defined) if defined else None
    se = (
        math.sqrt(sum((r - mean) ** 2 for r in defined) / (len(defined) - 1) / len(defined))
        if mean is not None and len(defined) > 1
        else None
    )
    pooled = torch.cat(kept_delta_d)
    return CriterionStats(
        corrective_per_seed=[float((dd < 0).float().mean()) if dd.numel() else None for dd in kept_delta_d],
        unsafe_keep_per_seed=rates,
        unsafe_keep_mean=mean,
        unsafe_keep_se=se,
        corrective_pooled=float((pooled < 0).float().mean()) if pooled.numel() else None,
        kept_pooled=int(pooled.numel()),
        kept_per_seed=[int(dd.numel()) for dd in kept_delta_d],
    )


def _compare(estimator: str, seeds: list[_SeedTokens]) -> Comparison:
    ratio = _criterion([s.ratio_kept_delta_d for s in seeds])
    predictive = _criterion([s.predictive_kept_delta_d for s in seeds])
    both = [
        (r, p)
        for r, p in zip(ratio.unsafe_keep_per_seed, predictive.unsafe_keep_per_seed, strict=True)
        if r is not None and p is not None
    ]
    return Comparison(
        estimator=estimator,
        disagreement_per_seed=[s.disagreements for s in seeds],
        ratio=ratio,
        predictive=predictive,
        predictive_wins=sum(p < r for r, p in both),
        ratio_wins=sum(r < p for r, p in both),
        seeds_compared=len(both),
    )


def _pct(mean: float | None, se: float | None = None) -> str:
    if mean is None:
        return "—"
    return f"{100 * mean:.1f}%" if se is None else f"{100 * mean:.1f} ± {100 * se:.1f}%"


ANALYSIS_COLUMNS = (
    "criterion",
    "estimator",
    "disagreement tokens / seed",
    "unsafe-keep (mean ± s.e.)",
    "corrective (pooled)",
    "kept (pooled)",
    "wins (seeds)",
)


def analysis_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    """The table's rows: for each estimator, the ratio criterion and the predictive one on the same tokens."""
    rows: list[tuple[str, ...]] = []
    for c in result.comparisons:
        per_seed = f"{sum(c.disagreement_per_seed) / max(len(c.disagreement_per_seed), 1):.1f}"
        for name, stats, wins in (
            ("ratio", c.ratio, c.ratio_wins),
            ("predictive", c.predictive, c.predictive_wins),
        ):
            rows.append(
                (
                    name,
                    c.estimator,
                    per_seed,
                    _pct(stats.unsafe_keep_mean, stats.unsafe_keep_se),
                    _pct(stats.corrective_pooled),
                    str(stats.kept_pooled),
                    f"{wins}/{c.seeds_compared}",
                )
            )
    return rows


def _table(title: str, columns: tuple[str, ...], text_columns: int, rows: list[tuple[str, ...]]) -> Table:
    """A rich table: the first `text_columns` columns left-aligned, the numbers right-aligned."""
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < text_columns else "right")
    for row in rows:
        table.add_row(*row)
    return table


def render_analysis_table(result: AnalysisResult) -> Table:
    n = max(len(result.seeds), 1)
    title = (
        f"Direction analysis: {len(result.seeds)} seeds, {result.divergence} δ={result.delta} K={result.k} "
        f"{result.precision}{', mismatch only (fresh rollout)' if result.setting == 'mismatch-only' else ''}, "
        f"ΔD after a {result.protocol} update; {sum(result.out_of_region_per_seed) / n:.0f} of "
        f"{sum(result.tokens_per_seed) / n:.0f} tokens per seed outside the region"
    )
    return _table(title, ANALYSIS_COLUMNS, 2, analysis_rows(result))


DIFFERENCE_COLUMNS = ("measure", "estimators", "mean difference", "95% interval", "seeds")


def _points(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.1f}"


def difference_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    """The paired differences between estimators, in percentage points."""
    return [
        (
            d.measure,
            f"{d.first} − {d.second}",
            _points(d.mean),
            "n/a" if d.low is None else f"[{_points(d.low)}, {_points(d.high)}]",
            str(d.seeds),
        )
        for d in result.estimator_differences
    ]


def render_difference_table(result: AnalysisResult) -> Table:
    title = (
        f"Estimators compared, predictive criterion: per-seed differences, mean and "
        f"{100 * result.level:.0f}% t-interval over {len(result.seeds)} seeds (percentage points)"
    )
    return _table(title, DIFFERENCE_COLUMNS, 2, difference_rows(result))


PROTOCOL_COLUMNS = (
    "estimator",
    "protocol",
    "unsafe-keep ratio",
    "unsafe-keep predictive",
    "corrective ratio",
    "corrective predictive",
    "wins ratio/predictive",
)


def protocol_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    """Each estimator's comparison under every protocol, side by side (the main one first)."""
    rows: list[tuple[str, ...]] = []
    for i, estimator in enumerate(ESTIMATORS):
        for protocol, comparisons in result.protocol_comparisons.items():
            c = comparisons[i]
            rows.append(
                (
                    estimator,
                    protocol + (" (main)" if protocol == result.protocol else ""),
                    _pct(c.ratio.unsafe_keep_mean, c.ratio.unsafe_keep_se),
                    _pct(c.predictive.unsafe_keep_mean, c.predictive.unsafe_keep_se),
                    _pct(c.ratio.corrective_pooled),
                    _pct(c.predictive.corrective_pooled),
                    f"{c.ratio_wins}/{c.predictive_wins} of {c.seeds_compared}",
                )
            )
    return rows


def render_protocol_table(result: AnalysisResult) -> Table:
    title = "ΔD under each update protocol, same disagreement tokens: " + "; ".join(
        f"{p}: {PROTOCOLS[p]}" for p in result.protocol_comparisons
    )
    return _table(title, PROTOCOL_COLUMNS, 2, protocol_rows(result))


# ---------------------------------------------------------------------------
# ΔD decomposed (decomposition.py; MATH.md, "ΔD decomposed")
# ---------------------------------------------------------------------------

PIECES = ("realized", "first_order", "own", "others", "momentum", "own_logit", "own_head")


@dataclass(frozen=True)
class _SeedDecomposition:
    """One seed's decomposition: per (protocol, criterion) the PIECES over the out-of-region tokens with
    A ≠ 0 that the criterion keeps; `assumption`: the own effects over all of them (as if kept)."""

    by_update: dict[tuple[str, str], dict[str, torch.Tensor]]
    assumption: dict[str, torch.Tensor]


def _decompose_seed(
    learner: Learner,
    cfg: ToyConfig,
    batch: Rollout,
    advantages: torch.Tensor,
    pre: dict[str, masks.Diagnostics],
    outside: torch.Tensor,
    criteria: dict[str, ToyConfig],
    parts: dict[tuple[str, str], decomposition.UpdateParts],
    delta: dict[tuple[str, str], torch.Tensor],
    *,
    reference: bool = False,
) -> _SeedDecomposition:
    """Per-token ΔD pieces at the learner's (start) weights; also fills `delta` for the own-effect
    protocols: ΔD of a kept token = its own effect, first order (zero on the tokens a criterion masks)."""
    a = advantages.unsqueeze(1).expand_as(outside)
    rows, cols = (outside & (a != 0)).nonzero(as_tuple=True)
    with torch.no_grad():
        logits = forward(
            learner.policy, batch.tokens[:, :-1], batch.sampled_ids.shape[1], PRECISIONS[cfg.precision].train
        )
    keys = list(parts)
    vectors = torch.stack(
        [v for k in keys for v in (parts[k].step, parts[k].momentum, parts[k].gain * parts[k].grad)], dim=1
    )
    n_params = vectors.shape[0]
    gains = torch.stack([parts[k].gain.expand(n_params) for k in keys], dim=1)
    token_products = decomposition.token_products_reference if reference else decomposition.token_products
    products = token_products(learner.policy, cfg, batch, rows, cols, vectors, gains)
    support = decomposition.token_support(
        batch, rows, cols, masks.DIVERGENCES[cfg.divergence].support, logits.shape[-1]
    )
    ddot_logit = decomposition.logit_ddot(logits[rows, cols], support, cfg.divergence)
    alpha = {
        n: decomposition.loss_coefficients(logits, batch, advantages, c)[rows, cols]
        for n, c in criteria.items()
    }
    by_update: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for i, key in enumerate(keys):
        p, coef = parts[key], alpha[key[1]]
        own = p.clip * coef * products.own[:, i]
        kept = coef != 0
        pieces = {
            "realized": delta[key][rows, cols].double(),
            "first_order": products.dot[:, 3 * i],
            "own": own,
            "others": products.dot[:, 3 * i + 2] - own,
            "momentum": products.dot[:, 3 * i + 1],
            "own_logit": -p.clip * coef * ddot_logit,
            "own_head": p.clip * coef * products.own_head[:, i],
        }
        by_update[key] = {name: v[kept] for name, v in pieces.items()}
    for name in criteria:
        carried = parts["carried", name]
        coef = alpha[name]
        own_adam = carried.clip * coef * products.own[:, keys.index(("carried", name))]
        own_grad = -cfg.lr * carried.clip * coef * products.plain
        for protocol, own in (("own-adam", own_adam), ("own-grad", own_grad)):
            full = torch.zeros(outside.shape, dtype=torch.float64)
            full[rows, cols] = own
            delta[protocol, name] = full
    unmasked = decomposition.loss_coefficients(logits, batch, advantages, criteria["ratio"], masked=False)
    coef = unmasked[rows, cols]
    i_adam = keys.index(("carried", "ratio"))
    assumption = {
        "logit": -coef * ddot_logit,
        "plain": -coef * products.plain,
        "plain_head": -coef * products.plain_head,
        "adam": coef * products.own[:, i_adam],
        "adam_head": coef * products.own_head[:, i_adam],
        "exact": (a[rows, cols] * pre["exact"].ddot[rows, cols]).double(),
        "ratio": (a[rows, cols] * (pre["agg"].ratio[rows, cols] - 1)).double(),
        "divergence_check": products.divergence - pre["agg"].divergence[rows, cols].double(),
    }
    return _SeedDecomposition(by_update, assumption)


def _median(x: torch.Tensor) -> float | None:
    x = x[torch.isfinite(x)]
    return float(x.median()) if x.numel() else None


def _agreement(piece: torch.Tensor, reference: torch.Tensor) -> float | None:
    """Share of tokens where piece and reference have the same sign (None where the piece is all zero)."""
    if not piece.numel() or not bool((piece != 0).any()):
        return None
    return float((torch.sign(piece) == torch.sign(reference)).double().mean())


def _shares(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    total = p["own"].abs() + p["others"].abs() + p["momentum"].abs()
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return {name: p[name].abs() / safe for name in ("own", "others", "momentum")}


def _head_share(total: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    whole = head.abs() + (total - head).abs()
    return head.abs() / torch.where(whole > 0, whole, torch.ones_like(whole))


def _decomposition_rows(seeds: list[_SeedDecomposition]) -> list[DecompositionRow]:
    if not seeds:
        return []
    rows = []
    for protocol, criterion in seeds[0].by_update:
        per_seed = [s.by_update[protocol, criterion] for s in seeds]
        pooled = {name: torch.cat([p[name] for p in per_seed]) for name in PIECES}
        shares = _shares(pooled)
        seed_shares = [_shares(p) for p in per_seed]
        realized = pooled["realized"]
        error = (realized - pooled["first_order"]).abs() / realized.abs()
        rows.append(
            DecompositionRow(
                protocol=protocol,
                criterion=criterion,
                tokens=int(realized.numel()),
                own_share=_median(shares["own"]),
                others_share=_median(shares["others"]),
                momentum_share=_median(shares["momentum"]),
                first_order_sign=_agreement(pooled["first_order"], realized),
                own_sign=_agreement(pooled["own"], realized),
                others_sign=_agreement(pooled["others"], realized),
                momentum_sign=_agreement(pooled["momentum"], realized),
                own_logit_sign=_agreement(pooled["own_logit"], realized),
                own_last_layer_share=_median(_head_share(pooled["own"], pooled["own_head"])),
                first_order_error=_median(error),
                own_share_per_seed=[_median(s["own"]) for s in seed_shares],
                others_share_per_seed=[_median(s["others"]) for s in seed_shares],
                momentum_share_per_seed=[_median(s["momentum"]) for s in seed_shares],
            )
        )
    return rows


ASSUMPTION_KINDS = (  # (row name, own effect, its head part or None)
    ("logit space, along e_k − π (the criterion's assumption)", "logit", None),
    ("last layer only, plain gradient", "plain_head", None),
    ("whole network, plain gradient", "plain", "plain_head"),
    ("whole network, carried Adam's gain", "adam", "adam_head"),
)


def _assumption_rows(seeds: list[_SeedDecomposition]) -> list[AssumptionRow]:
    if not seeds:
        return []
    pooled = {name: torch.cat([s.assumption[name] for s in seeds]) for name in seeds[0].assumption}
    return [
        AssumptionRow(
            own_effect=label,
            tokens=int(pooled[name].numel()),
            agrees_exact=_agreement(pooled[name], pooled["exact"]),
            agrees_ratio=_agreement(pooled[name], pooled["ratio"]),
            last_layer_share=_median(_head_share(pooled[name], pooled[head])) if head else None,
        )
        for label, name, head in ASSUMPTION_KINDS
    ]


DECOMPOSITION_COLUMNS = (
    "protocol",
    "criterion",
    "tokens",
    "share own",
    "share others",
    "share mom.",
    "sign 1st order",
    "sign own",
    "sign others",
    "sign mom.",
    "sign own logit",
    "own last layer",
    "1st-order error",
)


def decomposition_table_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    return [
        (
            r.protocol + (" (main)" if r.protocol == result.protocol else ""),
            r.criterion.replace("predictive/", "pred. "),
            str(r.tokens),
            _pct(r.own_share),
            _pct(r.others_share),
            _pct(r.momentum_share),
            _pct(r.first_order_sign),
            _pct(r.own_sign),
            _pct(r.others_sign),
            _pct(r.momentum_sign),
            _pct(r.own_logit_sign),
            _pct(r.own_last_layer_share),
            _pct(r.first_order_error),
        )
        for r in result.decomposition
    ]


def render_decomposition_table(result: AnalysisResult) -> Table:
    title = (
        "ΔD decomposed: first-order ΔD = own + others + momentum, over the out-of-region tokens with A ≠ 0 "
        "each criterion keeps (seeds pooled). share: median |piece| / (|own| + |others| + |momentum|); sign: "
        "share of tokens whose piece has the realized ΔD's sign; own last layer: median share of the head in "
        "the own effect; 1st-order error: median |realized − first order| / |realized|"
    )
    return _table(title, DECOMPOSITION_COLUMNS, 2, decomposition_table_rows(result))


ASSUMPTION_COLUMNS = (
    "a token's own effect on its D",
    "tokens",
    "sign = sign(A·Ḋ_exact)",
    "sign = sign(A(r − 1))",
    "last-layer share",
)


def assumption_table_rows(result: AnalysisResult) -> list[tuple[str, ...]]:
    return [
        (r.own_effect, str(r.tokens), _pct(r.agrees_exact), _pct(r.agrees_ratio), _pct(r.last_layer_share))
        for r in result.logit_assumption
    ]


def render_assumption_table(result: AnalysisResult) -> Table:
    title = (
        "The predictive criterion's assumption: a token's update moves its logits along e_k − π. Out-of-region "
        "tokens with A ≠ 0, each one's own gradient as if kept; agreement of its sign with each criterion's"
    )
    return _table(title, ASSUMPTION_COLUMNS, 1, assumption_table_rows(result))


SEED_CSV_COLUMNS = (
    "seed",
    "protocol",
    "estimator",
    "tokens",
    "out_of_region",
    "disagreements",
    "ratio_kept",
    "ratio_unsafe_keep",
    "ratio_corrective",
    "predictive_kept",
    "predictive_unsafe_keep",
    "predictive_corrective",
    "ratio_update_own_share",
    "ratio_update_others_share",
    "ratio_update_momentum_share",
    "predictive_update_own_share",
    "predictive_update_others_share",
    "predictive_update_momentum_share",
)


def seed_csv(result: AnalysisResult) -> str:
    """One row per seed, protocol and estimator: the rates and counts, and the median shares of the
    decomposition of the ratio criterion's and the predictive criterion's update (empty where none)."""
    import csv
    import io

    decomposed = {(r.protocol, r.criterion): r for r in result.decomposition}

    def cell(value) -> str:
        return "" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(SEED_CSV_COLUMNS)
    for protocol, comparisons in result.protocol_comparisons.items():
        for c in comparisons:
            ratio_row = decomposed.get((protocol, "ratio"))
            pred_row = decomposed.get((protocol, f"predictive/{c.estimator}"))
            for i, seed in enumerate(result.seeds):
                shares = [
                    getattr(row, f"{piece}_share_per_seed")[i] if row is not None else None
                    for row in (ratio_row, pred_row)
                    for piece in ("own", "others", "momentum")
                ]
                values = [
                    seed,
                    protocol,
                    c.estimator,
                    result.tokens_per_seed[i],
                    result.out_of_region_per_seed[i],
                    c.disagreement_per_seed[i],
                    c.ratio.kept_per_seed[i] if c.ratio.kept_per_seed else None,
                    c.ratio.unsafe_keep_per_seed[i],
                    c.ratio.corrective_per_seed[i],
                    c.predictive.kept_per_seed[i] if c.predictive.kept_per_seed else None,
                    c.predictive.unsafe_keep_per_seed[i],
                    c.predictive.corrective_per_seed[i],
                    *shares,
                ]
                writer.writerow([cell(v) for v in values])
    return out.getvalue()
