"""A learning curve on the LLM-like preset: response length, reward, entropy and top-K mass per step.

    python bench/llm_curve.py [--steps 40] [--method pdm] [--lr 2e-3] [--threads 1] [--csv curve.csv]

Trains `model=toy-llm` with every other setting the default run's (128 prompts x 8 per step, 8
mini-batches, the mask of --method) and prints, per step, the mean response length of the rollout,
its reward, the policy's entropy and top-K mass (train/entropy, train/topk_mass: the first
mini-batch, before the step's first update) and the share of tokens the mask drops; then the
held-out avg@16 at each evaluation. In this preset RL gains by choosing the long form (the "work",
19 tokens) over the short one (5), so the length should move (docs/TESTBED.md, "The LLM-like
preset"). Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from pdmctl.backends.base import InMemoryTracker
from pdmctl.backends.toy import ToyConfig, train

COLUMNS = ("train/response_length", "train/reward", "train/entropy", "train/topk_mass", "train/mask_frac")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--method", default="pdm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=ToyConfig.lr)
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ToyConfig(model="toy-llm", method=args.method, steps=args.steps, seed=args.seed, lr=args.lr,
                    checkpoint_every=max(args.steps, 1))  # fmt: skip
    tracker = InMemoryTracker()
    wall, cpu = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as workdir:
        train(cfg, Path(workdir), tracker)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rows = {name: dict(tracker.history(name)) for name in COLUMNS}
    lines = ["step," + ",".join(c.split("/")[1] for c in COLUMNS)]
    for step in sorted(rows[COLUMNS[0]]):
        lines.append(f"{step}," + ",".join(f"{rows[c].get(step, float('nan')):.4f}" for c in COLUMNS))
    print("\n".join(lines))
    for name in ("eval/toy24", "eval/toy25"):
        print(name, " ".join(f"{s}:{v:.3f}" for s, v in tracker.history(name)))
    print(f"{args.steps} steps, method {args.method}, lr {args.lr}, seed {args.seed}, {args.threads} thread(s): "
          f"{wall:.0f} s wall, {cpu:.0f} s CPU")  # fmt: skip
    if args.csv is not None:
        args.csv.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
