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
from dataclasses import dataclass

import torch
from rich.table import Table

from pdmctl import masks
from pdmctl.backends.toy import task
from pdmctl.backends.toy.bands import BandStats, band_analysis
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.model import PRECISIONS, forward
from pdmctl.backends.toy.rollout import Rollout
from pdmctl.backends.toy.trainer import Learner, grpo_advantages

ESTIMATORS = ("agg", "uni", "exact")
PROTOCOLS = {  # how the update that ΔD measures is taken, from the same weights
    "carried": "Adam with the state the stale mini-batch updates left (the step training takes next)",
    "fresh-adam": "a fresh Adam: the first step of a run, no momentum",
    "sgd": "the plain (clipped) gradient, no preconditioning, scaled to the fresh Adam step's length",
}
DEFAULT_PROTOCOLS = ("carried", "fresh-adam", "sgd")  # the first is the main table's


@dataclass(frozen=True)
class CriterionStats:
    """One direction criterion on one estimator's disagreement tokens."""

    unsafe_keep_per_seed: list[float | None]  # None where the criterion kept no disagreement token
    unsafe_keep_mean: float | None  # None where no seed has a rate (and the s.e. where fewer than two)
    unsafe_keep_se: float | None
    corrective_pooled: float | None  # ΔD < 0 among the kept disagreement tokens of all seeds together
    kept_pooled: int
    corrective_per_seed: list[float | None]  # ΔD < 0 among each seed's kept disagreement tokens


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
    bands: list[BandStats] = dataclasses.field(default_factory=list)  # by top-K mass (bands.py)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, allow_nan=False)


@dataclass(frozen=True)
class _SeedTokens:
    """One seed's disagreement tokens for one estimator: who keeps them and ΔD under each update."""

    ratio_kept_delta_d: torch.Tensor
    predictive_kept_delta_d: torch.Tensor
    disagreements: int


def run_analysis(
    cfg: ToyConfig, seeds: list[int], protocols: tuple[str, ...] = ("carried",)
) -> AnalysisResult:
    """The direction analysis on `seeds` (each a fresh rollout batch) with the config's mask settings, ΔD
    measured under each of `protocols` (the first is the main table's)."""
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        raise ValueError(f"protocols: unknown {unknown or 'none given'}; choose from {sorted(PROTOCOLS)}")
    per_seed: list[dict[str, dict[str, _SeedTokens]]] = []
    tokens, outside = [], []
    for seed in seeds:
        n_tokens, n_out, by_protocol = _analyse_seed(dataclasses.replace(cfg, seed=seed), protocols)
        tokens.append(n_tokens)
        outside.append(n_out)
        per_seed.append(by_protocol)
    by_protocol = {p: [_compare(e, [s[p][e] for s in per_seed]) for e in ESTIMATORS] for p in protocols}
    comparisons = by_protocol[protocols[0]]
    return AnalysisResult(
        seeds=list(seeds),
        delta=cfg.delta,
        k=cfg.k,
        divergence=cfg.divergence,
        precision=cfg.precision,
        tokens_per_seed=tokens,
        out_of_region_per_seed=outside,
        comparisons=comparisons,
        estimator_differences=_estimator_differences(comparisons),
        protocol=protocols[0],
        protocol_comparisons=by_protocol,
        bands=band_analysis(cfg, list(seeds)),
    )


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


def stale_batch(cfg: ToyConfig) -> tuple[Learner, Rollout, torch.Tensor]:
    """A fresh rollout batch from the base model and its advantages, with the learner moved on by all
    mini-batch updates of the step but the last: the staleness of a step's last mini-batch."""
    learner = Learner.from_base(cfg)
    problems = learner.task.sample_train(cfg.prompts_per_step, learner.generator).repeat(cfg.group_size)
    batch = learner.rollout(problems)
    advantages = grpo_advantages(learner.task.score(problems, batch.sampled_ids), cfg.group_size)
    order = torch.randperm(len(problems), generator=learner.generator)
    for rows in order.tensor_split(cfg.minibatches)[:-1]:
        learner.update(batch.select(rows), advantages[rows], cfg)
    return learner, batch, advantages


def _analyse_seed(
    cfg: ToyConfig, protocols: tuple[str, ...]
) -> tuple[int, int, dict[str, dict[str, _SeedTokens]]]:
    learner, batch, advantages = stale_batch(cfg)
    response = task.response_mask(batch.sampled_ids).bool()
    pre = {e: diagnostics(learner, batch, advantages, cfg, e) for e in ESTIMATORS}
    d_pre = pre["agg"].divergence  # D does not depend on the estimator
    outside = pre["agg"].out_of_region & response
    ratio_keep = advantages.unsqueeze(1) * (pre["agg"].ratio - 1) <= 0
    start = snapshot(learner)

    def delta_d_after(criterion: ToyConfig, protocol: str) -> torch.Tensor:
        take_update(learner, start, batch, advantages, criterion, protocol)
        return diagnostics(learner, batch, advantages, cfg, "agg").divergence - d_pre

    found: dict[str, dict[str, _SeedTokens]] = {}
    for protocol in protocols:
        delta_ratio = delta_d_after(dataclasses.replace(cfg, method="dppo"), protocol)
        found[protocol] = {}
        for e in ESTIMATORS:
            predictive_keep = advantages.unsqueeze(1) * pre[e].ddot <= 0
            disagree = outside & (ratio_keep != predictive_keep)
            delta_pred = delta_d_after(dataclasses.replace(cfg, method="pdm", estimator=e), protocol)
            found[protocol][e] = _SeedTokens(
                ratio_kept_delta_d=delta_ratio[disagree & ratio_keep],
                predictive_kept_delta_d=delta_pred[disagree & predictive_keep],
                disagreements=int(disagree.sum()),
            )
    return int(response.sum()), int(outside.sum()), found


def take_update(
    learner: Learner,
    start: Snapshot,
    batch: Rollout,
    advantages: torch.Tensor,
    criterion: ToyConfig,
    protocol: str,
) -> None:
    """One update with `criterion`'s mask on the whole batch from `start`, taken as `protocol` says."""
    restore(learner, start)
    if protocol == "carried":
        learner.update(batch, advantages, criterion)
        return
    params = list(learner.policy.parameters())
    fresh = dataclasses.replace(learner, optimizer=torch.optim.Adam(params, lr=criterion.lr))
    fresh.update(batch, advantages, criterion)
    if protocol == "fresh-adam":
        return
    # sgd: the clipped gradient itself (an SGD step of lr 1), rescaled to the fresh Adam step's length
    theta_adam = torch.nn.utils.parameters_to_vector(params).detach()
    restore(learner, start)
    theta = torch.nn.utils.parameters_to_vector(params).detach()
    dataclasses.replace(learner, optimizer=torch.optim.SGD(params, lr=1.0)).update(
        batch, advantages, criterion
    )
    with torch.no_grad():
        step = torch.nn.utils.parameters_to_vector(params) - theta
        norm = torch.linalg.vector_norm(step)
        scale = torch.linalg.vector_norm(theta_adam - theta) / norm if norm > 0 else torch.ones(())
        torch.nn.utils.vector_to_parameters(theta + step * scale, params)


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
    d = masks.token_diagnostics(
        logits.reshape(-1, logits.shape[-1]),
        batch.sampled_ids.reshape(-1),
        batch.topk_ids.reshape(-1, batch.topk_ids.shape[-1]),
        batch.topk_logprobs.reshape(-1, batch.topk_ids.shape[-1]),
        batch.sampled_logprobs.reshape(-1),
        advantages.unsqueeze(1).expand(shape).reshape(-1),
        method="pdm",
        divergence=cfg.divergence,
        estimator=estimator,
        delta=cfg.delta,
        delta_low=cfg.delta_low,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
    )
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
        f"{result.precision}, ΔD after a {result.protocol} update; {sum(result.out_of_region_per_seed) / n:.0f} of "
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
