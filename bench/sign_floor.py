"""The primary metric's labels in float32 against a float64 rerun of the same seed: how many signs flip.

For each PRESET:SEED, the seed's stale batch (`probe.stale_batch`, the analysis's), the counterfactual own effect
of every `exact` disagreement token under the ratio and the predictive (`exact`) criterion, once as the analysis
takes it (float32) and once with the learner's weights and Adam state cast to float64 (the recipe in
tests/test_counterfactual.py::test_signs_agree_above_the_float32_floor). Per criterion: the kept tokens (the
primary metric's), how many have |own| below counterfactual.SIGN_FLOOR in float32, how many unsafe labels
(own > 0) flip in float64, and the largest |own32 − own64|. toy-fork runs at its analysis setting
(precision=fp8_rollout, lr 2.5e-4).

    python bench/sign_floor.py toy-fork:1000 toy-small:1000 toy-llm:1058 ...

One thread; a few seconds of CPU per seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from pdmctl.analysis import counterfactual as cf
from pdmctl.backends.toy import task
from pdmctl.backends.toy.config import ToyConfig
from pdmctl.backends.toy.probe import diagnostics, stale_batch


def one_seed(model: str, seed: int) -> tuple[int, int, int]:
    extra = {"precision": "fp8_rollout", "lr": 2.5e-4} if model == "toy-fork" else {}
    cfg = ToyConfig(model=model, seed=seed, **extra)
    learner, batch, advantages = stale_batch(cfg)
    response = task.response_mask(batch.sampled_ids).bool()
    agg, exact = (diagnostics(learner, batch, advantages, cfg, e) for e in ("agg", "exact"))
    rows, cols = (agg.out_of_region & response).nonzero(as_tuple=True)
    a = advantages[rows]
    ratio_keep = a * (agg.ratio[rows, cols] - 1) <= 0
    predictive_keep = a * exact.ddot[rows, cols] <= 0
    disagree = ratio_keep != predictive_keep
    criteria = {"ratio": dataclasses.replace(cfg, method="dppo"),
                "predictive/exact": dataclasses.replace(cfg, method="pdm", estimator="exact")}  # fmt: skip
    start = time.process_time()
    e32 = cf.counterfactual_effects(learner, batch, advantages, criteria, rows, cols, variants=disagree)
    learner.policy.double()
    for state in learner.optimizer.state.values():
        state["exp_avg"], state["exp_avg_sq"] = state["exp_avg"].double(), state["exp_avg_sq"].double()
    e64 = cf.counterfactual_effects(learner, batch, advantages, criteria, rows, cols, variants=disagree)
    totals = [0, 0, 0]
    for name, keep in (("ratio", ratio_keep), ("predictive/exact", predictive_keep)):
        sel = disagree & keep
        own32, own64 = e32[name].own[sel], e64[name].own[sel]
        below = own32.abs() < cf.SIGN_FLOOR
        flips = (own32 > 0) != (own64 > 0)
        worst = float((own32 - own64).abs().max()) if sel.any() else 0.0
        print(f"  {model} seed {seed} {name}: kept {int(sel.sum())}, below the floor {int(below.sum())}, unsafe "
              f"{int((own32 > 0).sum())} (float32) / {int((own64 > 0).sum())} (float64), flips {int(flips.sum())} "
              f"({int((flips & below).sum())} below the floor), max |own32 − own64| {worst:.1e}")  # fmt: skip
        for i, v in enumerate((int(sel.sum()), int(below.sum()), int(flips.sum()))):
            totals[i] += v
    print(f"  ({time.process_time() - start:.1f} s CPU, kernels {torch.backends.cpu.get_cpu_capability()})")
    return totals[0], totals[1], totals[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seeds", nargs="+", help="PRESET:SEED, e.g. toy-fork:1000")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kept = below = flips = 0
    for item in args.seeds:
        model, _, seed = item.partition(":")
        k, b, f = one_seed(model, int(seed))
        kept, below, flips = kept + k, below + b, flips + f
    print(f"all: {kept:,} kept disagreement tokens, {below:,} below the floor, {flips} unsafe labels flip in float64 "
          f"({flips / max(kept, 1):.2%})")  # fmt: skip


if __name__ == "__main__":
    main()
