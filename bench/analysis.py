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

from pdmctl.analysis.protocols import DEFAULT_PROTOCOLS
from pdmctl.analysis.run import default_jobs, run_analysis
from pdmctl.backends.toy import ToyConfig


def timed(cfg: ToyConfig, seeds: list[int], **kwargs) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (its worker processes' not included)."""
    wall, cpu = time.perf_counter(), time.process_time()
    run_analysis(cfg, seeds, DEFAULT_PROTOCOLS, **kwargs)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="toy-small")
    parser.add_argument("--jobs", type=int, default=default_jobs())
    parser.add_argument("--seeds", type=int, default=None, help="seeds of the parallel run (default 2 per job)")
    parser.add_argument("--reference-prompts", type=int, default=None,
                        help="prompts per step of the before/after seed (default: the config's)")  # fmt: skip
    parser.add_argument("--no-reference", action="store_true", help="skip the slow reference seed")
    args = parser.parse_args()
    cfg = ToyConfig(model=args.preset)
    load = os.getloadavg()
    print(f"preset {args.preset}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")  # fmt: skip
    run_analysis(dataclasses.replace(cfg, prompts_per_step=8), [1], ("carried",), threads=1)  # base model, imports
    one = dataclasses.replace(cfg, prompts_per_step=args.reference_prompts or cfg.prompts_per_step)
    print(f"one seed, one thread, in this process ({one.prompts_per_step} prompts x {one.group_size}):")
    fast_wall, fast_cpu = timed(one, [1000], threads=1)
    print(f"  after  (fast):      {fast_wall:7.1f} s wall, {fast_cpu:7.1f} s CPU")
    if not args.no_reference:
        ref_wall, ref_cpu = timed(one, [1000], threads=1, reference=True)
        print(f"  before (reference): {ref_wall:7.1f} s wall, {ref_cpu:7.1f} s CPU  "
              f"-> {ref_cpu / fast_cpu:.1f}x less CPU per seed")  # fmt: skip
    n = args.seeds or 2 * args.jobs
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
