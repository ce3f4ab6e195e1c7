"""The CPU testbed's default run: wall time (median of 3), throughput and what it measured.

    python bench/testbed.py              # the default config, 3 times (base model built first, untimed)
    python bench/testbed.py --shares     # also: D > δ shares per precision at δ = 0.05 and 0.15, GRPO vs PDM
    python bench/testbed.py --tails      # also: the tails (base and final policy), what K and the
                                         # estimator change, and the 20-seed direction analysis, timed

Prints numbers and ratios; asserts nothing about time (machines differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdmctl.backends.base import InMemoryTracker
from pdmctl.backends.toy import ToyConfig, train
from pdmctl.backends.toy.basemodel import load_base_model
from pdmctl.backends.toy.task import HELDOUT_SIZE, MAX_RESPONSE_LEN
from pdmctl.backends.toy.trainer import EVAL_SETS


def run(cfg: ToyConfig, keep: dict | None = None) -> tuple[float, InMemoryTracker]:
    """Train in a scratch directory; with `keep`, the final policy is left in keep["policy"]."""
    tracker = InMemoryTracker()
    with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        train(cfg, Path(workdir), tracker)
        wall = time.perf_counter() - start
        if keep is not None:
            policy = load_base_model(cfg.model)
            (checkpoint,) = sorted((Path(workdir) / "checkpoints").glob("step_*.pt"))[-1:]
            policy.load_state_dict(torch.load(checkpoint, weights_only=True)["policy"])
            keep["policy"] = policy
        return wall, tracker


def print_tails(cfg: ToyConfig, final_policy) -> None:
    """The testbed's figures: tail shape, what K and the estimator change, the direction analysis."""
    from pdmctl.analysis.run import run_analysis
    from pdmctl.analysis.tables import difference_rows
    from pdmctl.backends.toy.tails import (
        DPPO_TOP20_MEAN,
        PROFILE_KS,
        QUANTILES,
        k_and_estimator_effects,
        tail_profile,
    )

    quantiles = "/".join(f"p{round(100 * q)}" for q in QUANTILES)
    print(f"\ntails: per response token sampled on the held-out sets; quantiles {quantiles} over tokens")
    for label, policy in (("base", load_base_model(cfg.model)), ("final", final_policy)):
        profile = tail_profile(policy)
        print(f"  {label} policy ({profile.tokens} tokens)")
        for k in PROFILE_KS:
            qs = " ".join(f"{v:.3f}" for v in profile.topk_mass[k])
            extra = f"   (DPPO, an LLM: {DPPO_TOP20_MEAN:.3f})" if k == 20 else ""
            print(f"    top-{k:<2} mass: mean {profile.topk_mass_mean[k]:.3f}  quantiles {qs}{extra}")
        print(f"    entropy (nats): mean {profile.entropy_mean:.2f}  quantiles "
              f"{' '.join(f'{v:.2f}' for v in profile.entropy)}; share > 1 nat {profile.high_entropy_share:.2f}")  # fmt: skip
        print(f"    top-20 mass by position: {' '.join(f'{v:.3f}' for v in profile.top20_by_position)}")

    seeds = list(range(1000, 1010))
    start = time.perf_counter()
    effects = k_and_estimator_effects(cfg, seeds)
    print(f"\nK and the estimator, on {effects.out_of_region} out-of-region tokens (D > δ at K=50) of "
          f"{len(seeds)} stale batches ({time.perf_counter() - start:.0f} s):")  # fmt: skip
    print(f"  mean D: K=10 {effects.mean_d[10]:.4f}, K=50 {effects.mean_d[50]:.4f}: "
          f"differ by {100 * effects.mean_d_change:.1f}% (target >= 10%)")  # fmt: skip
    print(f"  PDM (agg) keep decisions differing between K=10 and K=50: "
          f"{100 * effects.keep_differs_k:.1f}% (target >= 5%)")  # fmt: skip
    print("  sign(Ḋ) differing: " + ", ".join(f"{pair} {100 * v:.1f}%" for pair, v in effects.sign_differs.items())
          + " (target agg/uni >= 1%)")  # fmt: skip

    for k in (cfg.k, 10, 50):
        start = time.perf_counter()
        result = run_analysis(dataclasses.replace(cfg, k=k), list(range(1000, 1020)))
        wall = time.perf_counter() - start
        per_seed = {c.estimator: sum(c.disagreement_per_seed) / len(c.disagreement_per_seed) for c in result.comparisons}
        print(f"\npdmctl analyze --seeds 20 k={k}: {wall:.0f} s (target <= 300 s); disagreement tokens per seed "
              + ", ".join(f"{e} {n:.1f}" for e, n in per_seed.items()) + " (target >= 50)")  # fmt: skip
        for c in result.comparisons:
            print(f"  {c.estimator:5} unsafe-keep: ratio {_pct(c.ratio.unsafe_keep_mean)}, "
                  f"predictive {_pct(c.predictive.unsafe_keep_mean)}")  # fmt: skip
        for measure, pair, mean, interval, n in difference_rows(result):
            print(f"  {measure:11} {pair}: {mean} pp, 95% {interval} ({n} seeds)")


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def mean(tracker: InMemoryTracker, name: str) -> float:
    values = [v for _, v in tracker.history(name)]
    return sum(values) / len(values)


def held_out(tracker: InMemoryTracker) -> tuple[float, float]:
    """Mean over the held-out sets of avg@16, at the base model and at the end."""
    first = [tracker.history(f"eval/{name}")[0][1] for name in EVAL_SETS]
    last = [tracker.history(f"eval/{name}")[-1][1] for name in EVAL_SETS]
    return sum(first) / len(first), sum(last) / len(last)


def generated_tokens(cfg: ToyConfig, tracker: InMemoryTracker) -> int:
    """Every sampled token: all rows of every rollout and evaluation run MAX_RESPONSE_LEN steps."""
    evaluations = len(tracker.history(f"eval/{EVAL_SETS[0]}"))
    rollouts = cfg.steps * cfg.prompts_per_step * cfg.group_size
    evals = evaluations * len(EVAL_SETS) * HELDOUT_SIZE * cfg.eval_samples
    return (rollouts + evals) * MAX_RESPONSE_LEN


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shares", action="store_true", help="also measure D > δ shares per precision")
    parser.add_argument("--tails", action="store_true", help="also the tails and what K and the estimator change")
    args = parser.parse_args()

    cfg = ToyConfig()
    load_base_model(cfg.model)  # built (or loaded) outside the timing: the bench times a cached base
    walls = []
    kept: dict = {}
    for _ in range(args.repeats):
        wall, tracker = run(cfg, kept)
        walls.append(wall)
    wall = statistics.median(walls)
    tokens = generated_tokens(cfg, tracker)
    base, final = held_out(tracker)
    print(f"default config: {cfg}")
    print(
        f"wall: median {wall:.1f} s of {', '.join(f'{w:.1f}' for w in walls)} s (budget 60 s: {wall / 60:.2f}x)"
    )
    print(f"generated tokens/s: {tokens / wall:,.0f}  ({tokens:,} tokens)")
    print(
        f"optimizer steps/s: {cfg.steps * cfg.minibatches / wall:.2f}  ({cfg.steps * cfg.minibatches} steps)"
    )
    print(f"held-out avg@16 (mean of {', '.join(EVAL_SETS)}): base {base:.3f} -> final {final:.3f} "
          f"({final - base:+.3f}; target >= +0.15)")  # fmt: skip

    if args.tails:
        print_tails(cfg, kept["policy"])

    if args.shares:
        print("\nmethod  precision    delta  share D>delta  disagreements  base -> final avg@16  wall")
        for method in ("grpo", "pdm"):
            for precision in ("bf16", "fp8_rollout", "fp8_e2e"):
                for delta in (0.05, 0.15):
                    variant = dataclasses.replace(cfg, method=method, precision=precision, delta=delta)
                    wall, tracker = run(variant)
                    base, final = held_out(tracker)
                    share = mean(tracker, "train/out_of_region_frac")
                    count = sum(v for _, v in tracker.history("train/disagreement_count"))
                    print(f"{method:6}  {precision:11}  {delta:5}  {100 * share:12.2f}%  {count:13.0f}  "
                          f"{base:.3f} -> {final:.3f}        {wall:.1f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
