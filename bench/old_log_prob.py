"""VeRL's recompute of the old log-probs, on and off: the same run twice on the CPU engine, compared step for step.

    flock /tmp/pdmctl-engine.lock .venv-engine/bin/python bench/old_log_prob.py [--mask pdm_agg] [--steps 3] \
        [--set backend.lr=1e-4 ...]

Runs `pdmctl sweep backend=verl model=qwen3-tiny mask=M k=5 seed=0` for `--steps` steps twice, one
after the other (the engine environment's Python, the local executor, an embedded ledger each): once as
every pdmctl run trains (`backend.skip_old_log_prob=true`, VeRL's `bypass_mode`: no recompute forward)
and once with `backend.skip_old_log_prob=false` (VeRL recomputes `old_log_probs` with the actor before
the update; no loss of pdmctl's reads them). Then prints:

- per step, the metrics of both runs that say what was sampled and what was trained: the reward and
  response length (the rollout), VeRL's `actor/pg_loss` and `actor/grad_norm` (the loss and the norm of its
  gradient, before clipping), pdmctl's mask fraction and rollout/trainer gap; `same` where the two are
  equal to the last bit;
- the first micro-batch each run's actor trained on (`PDMCTL_VERL_DUMP_DIR`'s loss record): its response
  mask, advantages, ratio to the rollout, mask, VeRL's log-probs, each token's loss and the loss, exactly;
- the actor's weights in the last step's checkpoint, compared tensor by tensor (equal weights after
  every update: equal gradients at every step);
- what VeRL logs only with the recompute (the metric names of one run and not the other), and the
  seconds the recompute took (`timing_s/old_log_prob`) against the step's.

Exit 0 when the two runs sampled the same rollouts and every compared number is equal; 1 otherwise (the
comparison is printed either way). On the CPU engine the two runs sample different rollouts from step 1
although both set the same seed, so it exits 1 there and its step-1 losses are losses of different batches
(docs/VERL_BACKEND.md, where the measured run is written down); the metric names and the recompute's
seconds hold either way. One engine job at a time per machine: run it under the lock.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEP_METRICS = (  # what was sampled, then what was trained
    "critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
    "actor/pdmctl/mask_frac", "actor/pdmctl/rollout_probs_diff_mean",
)  # fmt: skip
ARMS = (("skip", "true"), ("recompute", "false"))


def _sweep(work: Path, mask: str, steps: int, skip: str, extra: list[str]) -> tuple[str, float]:
    """One run; its MLflow store's URI and the sweep's wall seconds."""
    work.mkdir(parents=True)
    env = {**os.environ, "PDMCTL_VERL_DUMP_DIR": str(work / "dump")}
    env.pop("MLFLOW_TRACKING_URI", None)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    command = [
        sys.executable, "-m", "pdmctl.cli", "sweep", "backend=verl", "model=qwen3-tiny", f"mask={mask}", "k=5",
        "seed=0", f"backend.total_training_steps={steps}", f"backend.save_freq={steps}",
        f"backend.test_freq={steps}", "backend.val_before_train=false", f"backend.skip_old_log_prob={skip}",
        *extra, "--name", f"old-log-prob-{skip}", "--wait", "--tracking-uri", uri,
    ]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"bench/old_log_prob.py: the sweep with skip_old_log_prob={skip} failed ({result.returncode}); "
                 f"see {work}\n{result.stderr[-2000:]}")  # fmt: skip
    return uri, time.monotonic() - started


def _run(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                "tags.`pdmctl.sweep` LIKE '%'")  # fmt: skip
    return client, run


def _history(client, run_id: str, name: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}


def _dump(work: Path) -> dict:
    """The loss record of the actor's first update micro-batch (the logits record may be the recompute's)."""
    import torch

    (loss,) = sorted((work / "dump").glob("loss-*.pt"))
    return {f"loss/{k}": v for k, v in torch.load(loss, weights_only=False).items()}


def _weights(work: Path, steps: int) -> dict:
    import torch

    (actor,) = work.glob(f"pdmctl-runs/*/*/*/checkpoints/global_step_{steps}/actor")
    out = {}
    for shard in sorted(actor.glob("model_world_size_*_rank_*.pt")):
        for name, tensor in torch.load(shard, weights_only=False, map_location="cpu").items():
            out[f"{shard.name}:{name}"] = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return out


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mask", default="pdm_agg")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="another override for both runs (the preset's lr of 1e-2 makes the tiny model answer "
                             "with one token after the first step: backend.lr=1e-4 keeps its answers varied)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps: at least 1")
    root = Path(tempfile.mkdtemp(prefix="pdmctl-bench-old-log-prob-"))
    uris, walls = {}, {}
    for arm, skip in ARMS:
        uris[arm], walls[arm] = _sweep(root / arm, args.mask, args.steps, skip, args.set)
    runs = {arm: _run(uri) for arm, uri in uris.items()}
    ok = True
    print(f"old log-probs: {args.mask} K=5 seed 0 {' '.join(args.set)}, {args.steps} steps of the tiny Qwen3 (VeRL 0.9.1 + vLLM CPU), "
          f"skip_old_log_prob=true ({walls['skip']:.0f} s) against false ({walls['recompute']:.0f} s)")  # fmt: skip
    print(f"{'step':>4}  {'metric':<38} {'skip (bypass_mode=true)':>24} {'recompute':>24}")
    for name in STEP_METRICS:
        values = {arm: _history(client, run.info.run_id, name) for arm, (client, run) in runs.items()}
        for step in range(1, args.steps + 1):
            a, b = values["skip"].get(step), values["recompute"].get(step)
            same = a is not None and a == b
            ok &= same
            print(f"{step:>4}  {name:<38} {a!r:>24} {b!r:>24}  {'same' if same else 'DIFFERENT'}")
    dumps = {arm: _dump(root / arm) for arm, _ in ARMS}
    for key in ("loss/response_mask", "loss/advantages", "loss/ratio", "loss/keep", "loss/log_prob",
                "loss/token_loss", "loss/loss"):
        same = _same(dumps["skip"][key], dumps["recompute"][key])
        ok &= same
        print(f"first micro-batch {key}: {tuple(getattr(dumps['skip'][key], 'shape', ()))} "
              f"{'same' if same else 'DIFFERENT'}")  # fmt: skip
    weights = {arm: _weights(root / arm, args.steps) for arm, _ in ARMS}
    differ = [k for k in weights["skip"] if not _same(weights["skip"][k], weights["recompute"].get(k))]
    ok &= bool(weights["skip"]) and not differ and set(weights["skip"]) == set(weights["recompute"])
    print(f"actor weights after step {args.steps}: {len(weights['skip'])} tensors, "
          f"{'all the same' if not differ else f'{len(differ)} differ (first {differ[0]})'}")  # fmt: skip
    names = {arm: set(run.data.metrics) for arm, (_, run) in runs.items()}
    print("logged only with the recompute:", ", ".join(sorted(names["recompute"] - names["skip"])) or "nothing")
    print("logged only with the skip:", ", ".join(sorted(names["skip"] - names["recompute"])) or "nothing")
    client, run = runs["recompute"]
    recompute = _history(client, run.info.run_id, "timing_s/old_log_prob")
    step_s = _history(client, run.info.run_id, "timing_s/step")
    shares = [f"{recompute[s]:.2f} s of {step_s[s]:.1f} s" for s in sorted(recompute) if s in step_s]
    print(f"the recompute forward (timing_s/old_log_prob of timing_s/step), per step: {'; '.join(shares)}")
    print("identical" if ok else "NOT identical: see above")
    if args.keep:
        print(f"workdir: {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
