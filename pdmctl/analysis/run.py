"""The token-level direction analysis (MATH.md, "The token-level direction analysis"; paper §4.2).

Per seed: a fresh rollout batch from the base model, made stale as in
training (all mini-batch updates of the step but the last), then, at those
weights, every response token's D, Ḋ and r against the rollout's μ. For the
tokens outside the region (D > δ) the ratio criterion keeps a token when
A(r − 1) ≤ 0, the predictive one when A·Ḋ ≤ 0; they disagree on a few. Each
criterion then takes one real update on the whole batch from the same weights
and optimizer state, and D is recomputed on the same tokens: ΔD > 0 on a kept
disagreement token is an unsafe keep, ΔD < 0 a corrective one.

How the update is taken is a protocol (`PROTOCOLS`). The main one, `counterfactual` (counterfactual.py),
measures the decision in one real update: per token, one Adam update on the whole batch after the step's
first mini-batch updates (the carried state, each member clipped by its own gradient norm) with it kept
against one with it masked, ΔD = D(keep) − D(mask). The earlier ones take one update per criterion and read the
realized ΔD: with the Adam state the stale mini-batch updates left (`carried`: the step training takes
next, whose ΔD is mostly the carried momentum), with a fresh Adam (`fresh-adam`), or as a plain
gradient step (`sgd`); they are measured and printed beside it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from pdmctl.analysis import decomposition
from pdmctl.analysis.bands import BandCounter, topk_mass
from pdmctl.analysis.counterfactual import SIGN_FLOOR, counterfactual_effects
from pdmctl.analysis.criteria import _compare, _estimator_differences, _SeedTokens
from pdmctl.analysis.decomposition_rows import (
    _assumption_rows,
    _decompose_seed,
    _decomposition_rows,
    _SeedDecomposition,
)
from pdmctl.analysis.protocols import (
    PROTOCOLS,
    UPDATE_PROTOCOLS,
    apply_update,
    criterion_gradients,
    restore,
    snapshot,
    take_update_reference,
)
from pdmctl.analysis.regime import regime_of
from pdmctl.analysis.results import ESTIMATORS, AnalysisResult, CounterfactualCounts, DisagreementTokens
from pdmctl.backends.toy import task
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.probe import diagnostics, stale_batch

# the counterfactual's pairs: every disagreement token, and this many out-of-region tokens drawn uniformly per
# seed (all where fewer): toy-small has 219 per seed (mean), toy-llm about 2,800, each pair a forward of the batch
COUNTERFACTUAL_SAMPLE = 128


def default_jobs() -> int:
    """The processes `run_analysis` spreads seeds over by default: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_analysis(
    cfg: ToyConfig,
    seeds: list[int],
    protocols: tuple[str, ...] = ("counterfactual",),
    *,
    jobs: int = 1,
    threads: int | None = 1,
    reference: bool = False,
    mismatch_only: bool = False,
    exact_region: bool = False,
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
    `carried` protocol's Adam has no state). `exact_region`: the counterfactual's region effect of every
    variant by a forward of the whole region at its weights (about ten times the CPU), not by first order
    (counterfactual.counterfactual_effects)."""
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        raise ValueError(f"protocols: unknown {unknown or 'none given'}; choose from {sorted(PROTOCOLS)}")
    if jobs < 1 or (threads is not None and threads < 1):
        raise ValueError(f"jobs and threads: must be >= 1, got {jobs} and {threads}")
    tasks = [
        (dataclasses.replace(cfg, seed=seed), tuple(protocols), reference, not mismatch_only, exact_region)
        for seed in seeds
    ]
    if jobs == 1 or len(seeds) == 1:
        keep_freed_memory()
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

        per_job = threads or 1
        with ProcessPoolExecutor(
            max_workers=min(jobs, len(seeds)),
            mp_context=multiprocessing.get_context("spawn"),  # no forked OpenMP pools, the same on every OS
            # first thing in a worker, before it imports torch: a killed `pdmctl analyze` leaves none behind
            initializer=_worker_start,
            initargs=(os.getpid(),),
        ) as pool:
            results = list(pool.map(functools.partial(_threads_then_seed_task, per_job), tasks))
    return _combine(cfg, list(seeds), tuple(protocols), results, "mismatch-only" if mismatch_only else "stale")


def _worker_start(parent_pid: int) -> None:
    from pdmctl.lifetime import end_with_parent

    end_with_parent(parent_pid)
    keep_freed_memory()


def keep_freed_memory() -> None:
    """glibc's malloc keeps what is freed for the next allocation (no trim, no mmap below 1 GiB) instead of
    giving it back to the kernel: a seed allocates and frees many [variants x parameters] tensors, and each
    fresh mapping costs a page fault per page (a toy-fork seed spent a fifth of its CPU in the kernel). The
    numbers are the same either way; elsewhere than glibc this does nothing. One `mallopt` call per setting
    through ctypes: no package offers it."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    for option, value in ((-1, 1 << 30), (-2, 1 << 28), (-3, 1 << 30)):  # M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD
        mallopt(option, value)


@dataclass(frozen=True)
class _SeedResult:
    tokens: int  # response tokens
    out_of_region: int
    by_protocol: dict[str, dict[str, _SeedTokens]]
    parts: _SeedDecomposition
    bands: BandCounter
    extras: _SeedExtras


def _threads_then_seed_task(threads: int, task: tuple[ToyConfig, tuple[str, ...], bool, bool, bool]) -> _SeedResult:
    torch.set_num_threads(threads)
    return _seed_task(task)


def _seed_task(task: tuple[ToyConfig, tuple[str, ...], bool, bool, bool]) -> _SeedResult:
    cfg, protocols, reference, stale, exact_region = task
    bands, extras = BandCounter.empty(), _SeedExtras()
    n_tokens, n_out, by_protocol, parts = _analyse_seed(
        cfg, protocols, bands, reference=reference, stale=stale, extras=extras, exact_region=exact_region
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
    result = AnalysisResult(
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
        counterfactual=_counterfactual_rows(results),
        model=cfg.model,
        region_check=[pair for r in results for pair in r.extras.region_check],
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
    return dataclasses.replace(result, regime=regime_of(result))


def _counterfactual_rows(results: list[_SeedResult]) -> list[CounterfactualCounts]:
    keys = list(results[0].extras.counterfactual) if results else []
    return [
        CounterfactualCounts(*key, *([r.extras.counterfactual[key][i] for r in results] for i in range(7)))
        for key in keys
    ]


def _g7(x: float) -> float:
    """7 significant digits (float32's): the JSON carries every disagreement token, so it stays small."""
    return float(f"{x:.7g}")


def _add_lists(lists: list[list[int]]) -> list[int]:
    return [sum(column) for column in zip(*lists, strict=True)] if lists else []


@dataclass
class _SeedExtras:
    """What one seed adds to the figures' data (filled by _analyse_seed)."""

    tokens_per_position: list[int] = dataclasses.field(default_factory=list)
    out_of_region_per_position: list[int] = dataclasses.field(default_factory=list)
    tokens: dict[str, dict[str, list]] = dataclasses.field(default_factory=dict)  # estimator -> field -> values
    # the counterfactual protocol's counts: (estimator, criterion, tokens, decision) -> (n, own up, own down,
    # region up, region down, own up with the clip factor held, |own| below the sign floor)
    counterfactual: dict[tuple[str, str, str, str], tuple[int, ...]] = dataclasses.field(
        default_factory=dict
    )
    # the counterfactual's region effect of a few variants: [first order, exact] (counterfactual_effects)
    region_check: list[list[float]] = dataclasses.field(default_factory=list)


def _counterfactual_counts(delta, region, held, outside, in_sample, ratio_keep, advantages, pre) -> dict:
    """Per estimator, criterion (ratio, predictive), token set (its disagreement tokens, all out-of-region
    ones: the uniform sample, `in_sample`) and decision (kept, masked): how many tokens, and on how many keeping
    raised (lowered) the token's own D and the mean D of the region, against masking; on how many it raised
    the token's own D with the clip factor held (`held`), and on how many |own| is below the float32 sign
    floor (counterfactual.SIGN_FLOOR: float32 rounding can reach a sign there)."""
    found = {}
    a = advantages.unsqueeze(1)
    for e in ESTIMATORS:
        predictive_keep = a * pre[e].ddot <= 0
        disagree = outside & (ratio_keep != predictive_keep)
        for criterion, keep, name in (("ratio", ratio_keep, "ratio"), ("predictive", predictive_keep, f"predictive/{e}")):
            own, reg, own_held = delta["counterfactual", name], region[name], held[name]
            for tokens, where in (("disagreement", disagree), ("out-of-region", outside & in_sample)):
                for decision, chosen in (("kept", keep), ("masked", ~keep)):
                    sel = where & chosen
                    o, r, h = own[sel], reg[sel], own_held[sel]
                    found[e, criterion, tokens, decision] = (
                        int(sel.sum()), int((o > 0).sum()), int((o < 0).sum()), int((r > 0).sum()), int((r < 0).sum()),
                        int((h > 0).sum()), int((o.abs() < SIGN_FLOOR).sum()),
                    )  # fmt: skip
    return found


def _analyse_seed(
    cfg: ToyConfig,
    protocols: tuple[str, ...],
    bands: BandCounter | None = None,
    *,
    reference: bool = False,
    stale: bool = True,
    extras: _SeedExtras | None = None,
    exact_region: bool = False,
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
    region: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}
    in_sample = torch.zeros(outside.shape, dtype=torch.bool)
    if "counterfactual" in protocols:  # ΔD: the token's D after its keep update minus after its mask update
        rows_o, cols_o = outside.nonzero(as_tuple=True)
        a_o = advantages[rows_o]
        disagree_any = torch.zeros(len(rows_o), dtype=torch.bool)
        for e in ESTIMATORS:
            disagree_any |= ratio_keep[rows_o, cols_o] != (a_o * pre[e].ddot[rows_o, cols_o] <= 0)
        # every disagreement token, and a uniform sample of the out-of-region ones (the "out-of-region" rows)
        order = torch.randperm(len(rows_o), generator=torch.Generator().manual_seed(cfg.seed))
        sampled = torch.zeros(len(rows_o), dtype=torch.bool)
        sampled[order[:COUNTERFACTUAL_SAMPLE]] = True
        effects_of = counterfactual_effects(
            learner, batch, advantages, criteria, rows_o, cols_o, variants=disagree_any | sampled,
            exact_region=exact_region, generator=torch.Generator().manual_seed(cfg.seed),
        )  # fmt: skip
        in_sample[rows_o, cols_o] = sampled
        checked = []
        for effects in {id(e): e for e in effects_of.values()}.values():  # criteria sharing a mask: once
            if effects.first_order:
                at = effects.region_exact.isfinite()
                checked += [[float(a), float(b)] for a, b in zip(effects.region[at], effects.region_exact[at], strict=True)]
        for name, effects in effects_of.items():
            own, reg, own_held = (torch.full(outside.shape, math.nan, dtype=torch.float64) for _ in range(3))
            own[rows_o, cols_o], reg[rows_o, cols_o] = effects.own, effects.region
            own_held[rows_o, cols_o] = effects.own_clip_held
            delta["counterfactual", name], region[name], held[name] = own, reg, own_held
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
    if extras is not None and region:
        extras.counterfactual = _counterfactual_counts(
            delta, region, held, outside, in_sample, ratio_keep, advantages, pre
        )
        extras.region_check = checked
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
