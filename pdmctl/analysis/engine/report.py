"""`pdmctl analyze --engine verl RUN_DIR --step N`: the snapshot's updates replayed, checked and analysed.

Prints the replay's checks against VeRL's own update, the float64 sign check, the primary metric and its
channels (inference.py's statistic, the snapshotted updates as its clusters) and the regime beside the
paper's (regime.py's rows)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pdmctl.analysis.engine.effects import (
    SAMPLE,
    UpdateEffects,
    analyse_update,
    primary_counts,
    realized_rates,
    sample_counts,
    sign_check,
)
from pdmctl.analysis.engine.replay import Replay, build_model, load_snapshot, snapshot_paths


@dataclass(frozen=True)
class EngineAnalysis:
    run_dir: Path
    step: int
    model_dir: str
    updates: list[UpdateEffects]


def analyse_run(run_dir: Path, step: int, model_dir: str | None = None, threads: int | None = None,
                model: object | None = None) -> EngineAnalysis:
    """Every snapshotted update of `step` in `run_dir` (SnapshotError: nothing to analyse)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    paths = snapshot_paths(run_dir, step)
    first = load_snapshot(paths[0])
    where = model_dir or first["settings"]["model_path"]
    model = model if model is not None else build_model(where)
    updates = []
    for path in paths:
        snapshot = first if path == paths[0] else load_snapshot(path)
        updates.append(analyse_update(Replay(snapshot, model), int(snapshot["minibatch"])))
        updates[-1].run = Path(run_dir).name
    return EngineAnalysis(Path(run_dir), step, str(where), updates)


def analyse_runs(run_dirs: list[Path], step: int, model_dir: str | None = None,
                 threads: int | None = None) -> EngineAnalysis:
    """Several runs' snapshots of `step` (each its seed's rollout) as one analysis: every update a cluster."""
    runs = []
    model = None
    for run_dir in run_dirs:
        runs.append(analyse_run(run_dir, step, model_dir, threads, model))
        if model is None and len(run_dirs) > 1:  # one model for every run (the weights come from each snapshot)
            model = build_model(runs[-1].model_dir)
    if len(runs) == 1:
        return runs[0]
    updates = [u for r in runs for u in r.updates]
    name = Path(f"{len(runs)} runs ({runs[0].run_dir.name} ...)")
    return EngineAnalysis(name, step, runs[0].model_dir, updates)


def _e(x: float) -> str:
    return f"{x:.2e}"


def replay_lines(analysis: EngineAnalysis) -> list[str]:
    lines = [f"ENGINE REPLAY {analysis.run_dir.name} step {analysis.step}: {len(analysis.updates)} update(s) "
             f"(mini-batches), model {analysis.model_dir}"]  # fmt: skip
    for u in analysis.updates:
        c = u.check
        if c is None:
            continue
        ok = "within" if c.optimizer_diff <= c.bound else "ABOVE"
        whole = "within" if c.full_diff <= c.bound else "ABOVE"
        forward = (f"VeRL's {c.micro_batches} packed micro-batch forward(s) in bf16" if c.micro_batches else
                   "each sequence alone in bf16: the snapshot has no record of VeRL's packed micro-batches")  # fmt: skip
        lines += [
            f"  update {u.run}/{u.index}: the run's own update replayed (every token as the run's mask decides) — VeRL's "
            f"gradients through the replay's clip and AdamW: max |Δw| {_e(c.optimizer_diff)} from VeRL's weights "
            f"after, {ok} float32 rounding's {_e(c.bound)}",
            f"    the replay's own forward ({forward}): gradient {_e(c.grad_rel_diff)} from VeRL's (relative "
            f"norm; grad norm {c.grad_norm_replay:.6g} against VeRL's {c.grad_norm_verl:.6g}); its whole update: "
            f"max |Δw| {_e(c.full_diff)} from VeRL's weights after, {whole} float32 rounding's {_e(c.bound)} (VeRL's "
            f"step moved them up to {_e(c.step_size)}); a float32 forward keeps {c.flipped} token(s) otherwise",
        ]  # fmt: skip
    sample = sample_counts(analysis.updates)
    lines.append("OUT-OF-REGION SAMPLE (up to " + str(SAMPLE) + " tokens an update, not disagreement tokens; the "
                 "criteria decide them alike): own > 0 on the kept, own < 0 on the masked: " + ", ".join(
                     f"{c} {up}/{kept} kept, {down}/{masked} masked" for c, (kept, up, masked, down) in sample.items()))  # fmt: skip
    s = sign_check(analysis.updates)
    lines.append(f"FLOAT64 the counterfactual rerun in float64: signs of own effects agree on {s.agree}/{s.above} "
                 f"above the floor {_e(s.floor)} (2 × the largest |D(float32) − D(float64)| after the criteria's own "
                 f"updates); {s.pairs - s.above} of {s.pairs} below it")  # fmt: skip
    return lines


def primary(analysis: EngineAnalysis):
    from pdmctl.analysis.inference import (
        PrimaryMetric,
        cluster_bootstrap,
        effective_seeds,
        pooled_difference,
        sign_flip_p,
    )

    counts = primary_counts(analysis.updates)
    label = f"engine {analysis.run_dir.name} step {analysis.step}"
    n = len(analysis.updates)
    if not (sum(counts[1]) and sum(counts[3])):
        nan = math.nan
        return PrimaryMetric(label, nan, nan, nan, sum(counts[1]), sum(counts[3]), nan, nan, nan, 0, n)
    low, high = cluster_bootstrap(*counts)
    rates = [(a / b - c / d) for a, b, c, d in zip(*counts, strict=True) if b and d]
    return PrimaryMetric(
        label=label, pooled=pooled_difference(*counts), low=low, high=high, kept_predictive=sum(counts[1]),
        kept_ratio=sum(counts[3]), per_seed_mean=sum(rates) / len(rates) if rates else math.nan, t_low=math.nan,
        t_high=math.nan, seeds_compared=len(rates), seeds=n, p=sign_flip_p(*counts),
        effective_seeds=effective_seeds([a + b for a, b in zip(counts[1], counts[3], strict=True)]),
    )  # fmt: skip


def channel_lines(analysis: EngineAnalysis) -> list[str]:
    from pdmctl.analysis.inference import (
        _interval,
        _p,
        _pts,
        cluster_bootstrap,
        pooled_difference,
        sign_flip_p,
    )

    lines = [f"CHANNELS engine step {analysis.step}: the primary statistic (predictive − ratio unsafe-keep rate, "
             "exact disagreement tokens, pooled; the updates as clusters) from each measurement of a token's effect"]  # fmt: skip
    for name, held, question in (
        ("whole step", False, "one real update from the snapshot, each member clipped by its own gradient norm"),
        ("clip held", True, "the other member's gradient scaled by the criterion's own update's clip factor"),
    ):
        counts = primary_counts(analysis.updates, held=held)
        if not (sum(counts[1]) and sum(counts[3])):
            lines.append(f"  {name + ':':23s}not measured (a criterion kept no disagreement token)")
            continue
        low, high = cluster_bootstrap(*counts)
        lines.append(f"  {name + ':':23s}{_pts(pooled_difference(*counts))} points, 95% cluster bootstrap "
                     f"{_interval(low, high)}, sign-flip p {_p(sign_flip_p(*counts))}")  # fmt: skip
        lines.append(f"  {'':23s}({question})")
    lines.append(f"  {'own step, first order:':23s}not measured on the engine (the testbed's own-adam protocol)")
    return lines


def regime_table(analysis: EngineAnalysis):
    from pdmctl.analysis.regime import REGIME_COLUMNS, regime_rows
    from pdmctl.analysis.results import Regime
    from pdmctl.analysis.tables import _table

    updates = analysis.updates
    tokens = sum(u.tokens for u in updates)
    out = sum(int(u.out_of_region.sum()) for u in updates)
    per = sorted(int(u.disagree.sum()) for u in updates)
    rates = realized_rates(updates)
    regime = Regime(
        response_tokens=tokens, out_of_region=out, out_of_region_share=out / tokens if tokens else None,
        estimator="exact", disagreements=sum(per), disagreement_share=sum(per) / out if out else None,
        disagreements_median_per_seed=float(per[len(per) // 2]) if per else None,
        disagreements_mean_per_seed=sum(per) / len(per) if per else None, realized_protocol="VeRL's update",
        unsafe_keep_ratio=rates["ratio"][0], unsafe_keep_predictive=rates["predictive"][0],
        unsafe_keep_ratio_pooled=rates["ratio"][1], unsafe_keep_predictive_pooled=rates["predictive"][1],
    )  # fmt: skip
    title = (f"The regime beside the paper's (§4.2): {len(updates)} update(s) of step {analysis.step} as the "
             "seeds; a verdict here speaks to the paper's claim only as far as these agree")  # fmt: skip
    return _table(title, REGIME_COLUMNS, 1, regime_rows(regime, len(updates)))


def lines_of(analysis: EngineAnalysis) -> list[str]:
    from pdmctl.analysis.inference import primary_lines

    return replay_lines(analysis) + primary_lines(primary(analysis)) + channel_lines(analysis)
