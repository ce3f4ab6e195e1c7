"""Coverage of the analysis's two 95% intervals with each preset's real per-seed token counts.

`pdmctl.analysis.inference.coverage` draws each simulated seed's kept disagreement tokens (predictive, ratio)
from a preset's own 61 seeds (docs/results/analysis/<preset>/seeds.csv, the primary protocol and estimator),
unsafe rates 0.35 vs 0.55 (a difference) and 0.45 vs 0.45 (none), a seed effect on the logit scale; the
Poisson(40) shape of the docs' first table beside them. Prints, per shape and seed count, how often each
interval covers the truth; under no difference, 1 - coverage is how often an interval says "excludes 0"
wrongly (about, the truth being the simulation's own pooled difference, near but not exactly 0).

    python bench/coverage.py [--simulations 1000] [--resamples 2000] [--seeds 3,5,10,20,61]

numpy's generator with fixed seeds: the same figures on any machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from pdmctl.analysis.inference import coverage, real_counts

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("toy-small", "toy-llm", "toy-fork")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulations", type=int, default=1000)
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seeds", default="3,5,10,20,61")
    args = parser.parse_args()
    seed_counts = [int(x) for x in args.seeds.split(",")]
    shapes: dict[str, np.ndarray | None] = {"Poisson(40)": None}
    for preset in PRESETS:
        counts = real_counts(ROOT / "docs" / "results" / "analysis" / preset / "seeds.csv")
        shapes[preset] = counts
        kept = counts.sum(1)
        top5 = np.sort(kept)[::-1][:5].sum() / max(kept.sum(), 1)
        print(f"{preset}: {len(counts)} seeds, kept tokens per seed median {np.median(counts, 0).tolist()}, "
              f"{(counts.min(1) == 0).sum()} seeds with none on a side, top 5 seeds hold {100 * top5:.1f}%")
    started = time.process_time()
    print(f"\n{args.simulations} simulations, {args.resamples} resamples; coverage, bootstrap / t (95% nominal)")
    print(f"{'shape':<12} {'rates':<11} " + " ".join(f"{n:>13}" for n in seed_counts))
    for name, counts in shapes.items():
        for rates in ((0.35, 0.55), (0.45, 0.45)):
            cells = []
            for i, n in enumerate(seed_counts):
                rng = np.random.default_rng(1000 * i + n)
                boot, t = coverage(n, args.simulations, rng, resamples=args.resamples, counts=counts, rates=rates)
                cells.append(f"{100 * boot:5.1f} / {100 * t:5.1f}")
            print(f"{name:<12} {rates[0]:.2f}/{rates[1]:.2f}  " + " ".join(f"{c:>13}" for c in cells), flush=True)
    print(f"\n{time.process_time() - started:.0f} CPU-s")


if __name__ == "__main__":
    main()
