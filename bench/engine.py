"""The real engine on this machine, measured: one VeRL job through `pdmctl sweep`, as a user runs it.

    .venv-engine/bin/python bench/engine.py [--mask pdm_agg] [--k 5] [--steps 6]

Runs `pdmctl sweep backend=verl model=qwen3-tiny mask=M k=K --wait` (the engine environment's
Python, the local executor, an embedded ledger in a fresh directory) and prints:

- wall: the sweep command from start to end;
- start-up: from the command's start to the first training step's start (Ray, the actor, vLLM,
  the validation before training), then the first step, which warms up;
- step: VeRL's `timing_s/step` of the steps between the first (warm-up) and the last (which
  validates and checkpoints): median and range, and the phases of the median step (generation,
  old log-prob, actor update);
- peak memory: the machine's (MemTotal − MemAvailable, less what was in use before) and the summed
  proportional set size (PSS: shared pages split between their processes, unlike RSS) of the job's
  engine processes (those with its `PDMCTL_ENGINE_TAG`), sampled every 0.5 s;
- the mask's share of the actor: the seconds in `actor_loss.diagnose_rows`, written by each actor process
  (`PDMCTL_VERL_PROFILE_DIR`), within the steps after the first, against VeRL's `timing_s/old_log_prob
  + timing_s/update_actor` for the same steps (the logits processor runs in both forward passes).
  The steps measured are those between the first and the last.

The model and data are the cached tiny Qwen3 (`PDMCTL_TINY_DIR`, else built on first use). One engine
job at a time per machine: the bench waits on the machine lock like any engine job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdmctl.backends.verl import cpu, topk

GB = 1024**3


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        out[name] = int(value.split()[0]) * 1024
    return out


def _used() -> int:
    info = _meminfo()
    return info["MemTotal"] - info["MemAvailable"]


def _pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class MemorySampler(threading.Thread):
    """Peak machine memory in use (above the baseline) and peak summed PSS of engine processes."""

    def __init__(self, period_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.baseline = _used()
        self.machine_peak = 0
        self.engine_peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.machine_peak = max(self.machine_peak, _used() - self.baseline)
            by_tag: dict[str, int] = {}
            for pid, tag in cpu._engine_tags():
                by_tag[tag] = by_tag.get(tag, 0) + _pss(pid)
            if by_tag:
                self.engine_peak = max(self.engine_peak, max(by_tag.values()))
            self.stop.wait(self.period_s)


def _history(client, run_id: str, name: str) -> dict[int, tuple[float, int]]:
    """step -> (value, timestamp in ms) of one metric."""
    return {m.step: (m.value, m.timestamp) for m in client.get_metric_history(run_id, name)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mask", default="pdm_agg")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="training steps (at least 3)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps: at least 3 (the first step warms up; the last validates and checkpoints)")

    work = Path(tempfile.mkdtemp(prefix="pdmctl-bench-engine-"))
    profile_dir = work / "profile"
    env = {**os.environ, topk.PROFILE_ENV: str(profile_dir)}
    env.pop("MLFLOW_TRACKING_URI", None)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    command = [
        sys.executable, "-m", "pdmctl.cli", "sweep", "backend=verl", "model=qwen3-tiny",
        f"mask={args.mask}", f"k={args.k}", f"backend.total_training_steps={args.steps}",
        f"backend.save_freq={args.steps}", "--name", "bench-engine", "--wait", "--tracking-uri", uri,
    ]  # fmt: skip
    sampler = MemorySampler()
    sampler.start()
    started = time.time()
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    wall = time.time() - started
    sampler.stop.set()
    sampler.join()
    if result.returncode != 0:
        sys.exit(
            f"bench/engine.py: the sweep failed ({result.returncode}); see {work}\n{result.stderr[-2000:]}"
        )

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.`pdmctl.sweep` LIKE '%'")
    if run.info.status != "FINISHED":
        sys.exit(f"bench/engine.py: the run ended {run.info.status}; see {work}")
    rid = run.info.run_id
    phases = {name: _history(client, rid, f"timing_s/{name}")
              for name in ("step", "gen", "old_log_prob", "update_actor", "testing", "save_checkpoint")}  # fmt: skip
    steps = sorted(phases["step"])
    first = steps[0]
    step_s, step_end = phases["step"][first]
    startup = step_end / 1000 - step_s - started

    last_s = phases["step"][steps[-1]][0]
    last_val = phases["testing"].get(steps[-1], (0.0,))[0]  # VeRL times the final validation apart
    later = steps[1:-1]  # between the warm-up and the validating, checkpointing last step
    train = [phases["step"][s][0] for s in later]
    median_step = min(later, key=lambda s: abs(phases["step"][s][0] - statistics.median(train)))

    # the mask's seconds inside the later steps, against the actor's two forward passes in them
    windows = [
        (phases["step"][s][1] / 1000 - phases["step"][s][0], phases["step"][s][1] / 1000) for s in later
    ]
    lines = [
        json.loads(line)
        for f in sorted(profile_dir.glob("mask-*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    in_steps = [x for x in lines if any(a <= x["end"] <= b for a, b in windows)]
    mask_s = sum(x["s"] for x in in_steps)
    actor_s = sum(phases[p][s][0] for s in later for p in ("old_log_prob", "update_actor") if s in phases[p])

    print(f"engine: {args.mask} K={args.k}, {len(steps)} steps of the tiny Qwen3 (VeRL 0.9.1 + vLLM CPU), "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    print(f"wall: {wall:.0f} s; start-up {startup:.0f} s (to the first step's start, incl. Ray, vLLM and "
          f"the validation before training); first step {step_s:.1f} s")  # fmt: skip
    print(f"step: median {statistics.median(train):.2f} s (range {min(train):.2f}-{max(train):.2f}, steps "
          f"{later[0]}-{later[-1]}; the last {last_s:.1f} s with its checkpoint, then validation {last_val:.1f} s); in the median step: generation "
          f"{phases['gen'][median_step][0]:.2f} s, old log-prob {phases['old_log_prob'].get(median_step, (0.0,))[0]:.2f} s, "
          f"actor update {phases['update_actor'][median_step][0]:.2f} s")  # fmt: skip
    print(f"peak memory: machine {sampler.machine_peak / GB:.1f} GB above the {sampler.baseline / GB:.1f} GB in use "
          f"before; engine processes' summed PSS {sampler.engine_peak / GB:.1f} GB")  # fmt: skip
    share = mask_s / actor_s if actor_s else float("nan")
    print(f"mask: {mask_s:.3f} s in {len(in_steps)} calls ({sum(x['rows'] for x in in_steps)} response tokens) of "
          f"{actor_s:.2f} s actor time (old log-prob + update) in steps {later[0]}-{later[-1]}: {share:.1%}")  # fmt: skip
    if args.keep:
        print(f"workdir: {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
