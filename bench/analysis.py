"""The direction analysis's cost per seed, the reference path against the fast one, and the 61-seed projection.

    python bench/analysis.py                      # toy-small: reference vs fast on one seed, then 2·jobs seeds
    python bench/analysis.py --preset toy-llm --reference-prompts 32
                                                  # toy-llm's reference is slow: measure it on a smaller batch

"before" is `run_analysis(reference=True)`: one Learner.update per criterion and protocol and
whole-network per-token jacobians, the code as it was; "after" the default path. Both run one seed
in this process with one torch thread, all five protocols. Then `--seeds` seeds (default 2 per job)
run as `pdmctl analyze` runs them (`--jobs` spawned workers, one thread each), and the wall time
gives the projection for the paper's 61 seeds. The machine's load is printed: on a shared machine
the numbers move with it. Prints numbers and ratios; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from pdmctl.analysis.inference import PRIMARY_ESTIMATOR, primary_metric
from pdmctl.analysis.protocols import DEFAULT_PROTOCOLS
from pdmctl.analysis.run import default_jobs, run_analysis
from pdmctl.backends.toy import ToyConfig


def timed(cfg: ToyConfig, seeds: list[int], **kwargs) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (its worker processes' not included)."""
    wall, cpu = time.perf_counter(), time.process_time()
    run_analysis(cfg, seeds, DEFAULT_PROTOCOLS, **kwargs)
    return time.perf_counter() - wall, time.process_time() - cpu


def primary_counts(result) -> dict[str, tuple[list[int], list[int]]]:
    """Per criterion, the primary metric's per-seed counts: kept disagreement tokens, unsafe keeps."""
    return {c.criterion: (c.n, c.own_up) for c in result.counterfactual
            if (c.estimator, c.tokens, c.decision) == (PRIMARY_ESTIMATOR, "disagreement", "kept")}  # fmt: skip


def exact_vs_first_order(cfg: ToyConfig, seeds: list[int], jobs: int) -> None:
    """Each seed in this process, one thread: every region effect exact, then by first order."""
    print(f"the counterfactual's region effect, exact vs first order ({cfg.prompts_per_step} prompts x "
          f"{cfg.group_size}, one thread, every default protocol):")  # fmt: skip
    total_new = 0.0
    for seed in seeds:
        cpu = time.process_time()
        old = run_analysis(cfg, [seed], DEFAULT_PROTOCOLS, threads=1, exact_region=True)
        old_cpu, cpu = time.process_time() - cpu, time.process_time()
        new = run_analysis(cfg, [seed], DEFAULT_PROTOCOLS, threads=1)
        new_cpu = time.process_time() - cpu
        total_new += new_cpu
        checks = new.region_check
        err = max((abs(a - b) for a, b in checks), default=float("nan"))
        signs = sum((a > 0) == (b > 0) for a, b in checks)
        a, b = primary_metric(old, resamples=1).pooled, primary_metric(new, resamples=1).pooled
        print(f"  seed {seed}: exact {old_cpu:6.1f} s CPU, first order {new_cpu:5.1f} s -> {old_cpu / new_cpu:4.1f}x; "
              f"primary counts {primary_counts(old)} vs {primary_counts(new)}: "
              f"{'equal' if primary_counts(old) == primary_counts(new) else 'DIFFERENT'}; "
              f"primary {100 * a:+.2f} vs {100 * b:+.2f}; region checks: {len(checks)}, max |error| {err:.2e}, "
              f"signs {signs}/{len(checks)}")  # fmt: skip
    per_seed = total_new / len(seeds)
    print(f"  projection for 61 seeds at {per_seed:.1f} s CPU each on {jobs} core(s): {61 * per_seed / jobs / 60:.1f} min")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="toy-small")
    parser.add_argument("--jobs", type=int, default=default_jobs())
    parser.add_argument("--seeds", type=int, default=None, help="seeds of the parallel run (default 2 per job)")
    parser.add_argument("--reference-prompts", type=int, default=None,
                        help="prompts per step of the before/after seed (default: the config's)")  # fmt: skip
    parser.add_argument("--no-reference", action="store_true", help="skip the fast and the slow reference seed")
    parser.add_argument("--precision", default=None, help="the config's precision (default: the preset's)")
    parser.add_argument("--lr", type=float, default=None, help="the config's learning rate")
    parser.add_argument("--exact-seeds", type=int, default=1,
                        help="seeds timed with the region effect exact and by first order (0: none)")  # fmt: skip
    args = parser.parse_args()
    cfg = ToyConfig(model=args.preset)
    if args.precision:
        cfg = dataclasses.replace(cfg, precision=args.precision)
    if args.lr:
        cfg = dataclasses.replace(cfg, lr=args.lr)
    load = os.getloadavg()
    print(f"preset {args.preset}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")  # fmt: skip
    run_analysis(dataclasses.replace(cfg, prompts_per_step=8), [1], ("carried",), threads=1)  # base model, imports
    if not args.no_reference:
        one = dataclasses.replace(cfg, prompts_per_step=args.reference_prompts or cfg.prompts_per_step)
        print(f"one seed, one thread, in this process ({one.prompts_per_step} prompts x {one.group_size}):")
        fast_wall, fast_cpu = timed(one, [1000], threads=1)
        print(f"  after  (fast):      {fast_wall:7.1f} s wall, {fast_cpu:7.1f} s CPU")
        ref_wall, ref_cpu = timed(one, [1000], threads=1, reference=True)
        print(f"  before (reference): {ref_wall:7.1f} s wall, {ref_cpu:7.1f} s CPU  "
              f"-> {ref_cpu / fast_cpu:.1f}x less CPU per seed")  # fmt: skip
    if args.exact_seeds:
        exact_vs_first_order(cfg, list(range(1000, 1000 + args.exact_seeds)), args.jobs)
    n = args.seeds if args.seeds is not None else 2 * args.jobs
    if n == 0:
        return
    seeds = list(range(1000, 1000 + n))
    wall, _ = timed(cfg, seeds, jobs=args.jobs, threads=1)
    per_seed = wall / n
    print(f"{n} seeds in {args.jobs} worker processes, one thread each ({cfg.prompts_per_step} prompts x "
          f"{cfg.group_size}): {wall:.1f} s wall, {per_seed:.2f} s per seed")  # fmt: skip
    print(f"  projection for 61 seeds: {61 * per_seed / 60:.1f} min (the target: 5 min)")
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
