"""The CPU testbed's default run: wall time (median of 3), throughput and what it measured.

    python bench/testbed.py              # the default config, 3 times (base model built first, untimed)
    python bench/testbed.py --shares     # also: D > δ shares per precision at δ = 0.05 and 0.15, GRPO vs PDM

Prints numbers and ratios; asserts nothing about time (machines differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from pdmctl.backends.base import InMemoryTracker
from pdmctl.backends.toy import ToyConfig, train
from pdmctl.backends.toy.basemodel import load_base_model
from pdmctl.backends.toy.task import HELDOUT_SIZE, MAX_RESPONSE_LEN
from pdmctl.backends.toy.trainer import EVAL_SETS


def run(cfg: ToyConfig) -> tuple[float, InMemoryTracker]:
    tracker = InMemoryTracker()
    with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        train(cfg, Path(workdir), tracker)
        return time.perf_counter() - start, tracker


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
    args = parser.parse_args()

    cfg = ToyConfig()
    load_base_model(cfg.model)  # built (or loaded) outside the timing: the bench times a cached base
    walls = []
    for _ in range(args.repeats):
        wall, tracker = run(cfg)
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
    print(f"held-out avg@16 (mean of {', '.join(EVAL_SETS)}): base {base:.3f} -> final {final:.3f}")

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
