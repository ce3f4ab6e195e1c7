#!/usr/bin/env bash
# The engine checks on a user's own GPU node, in one command: what CI runs with vLLM's CPU build, run
# with CUDA vLLM.
#
#   bash scripts/gpu-check.sh [QWEN3_4B_BASE_DIR]
#
# What it needs (it is not the check for the device machine this project is lent, which has no
# network and Python 3.12: that one is scripts/device-check.sh, torch/Triton/numpy only):
#   - an NVIDIA GPU node with nvidia-smi and a CUDA driver vLLM 0.24.0's wheel runs on;
#   - Python 3.11 (python3.11, or $PDMCTL_ENGINE_PYTHON), g++ and network access to the package index:
#     step 1 installs scripts/engine-cuda.lock (vLLM's CUDA build, VeRL 0.9.1, megatron-core + mbridge,
#     Transformer Engine, whose PyTorch binding it compiles; Ray among them), about 11 GB, and checks
#     the driver against torch's CUDA 13.0 build (R580 or newer: docs/CLUSTER.md);
#   - for step 3, root and Debian's slurm-wlm (installed or installable); without them the step is
#     left out with one line saying why;
#   - for step 4, a local copy of Qwen/Qwen3-4B-Base (no model hub is asked) and a GPU that holds
#     one training step of it (bf16 weights, gradients and Adam states: about 64 GB before
#     activations, so an 80 GB GPU or more), and about 50 GB of disk for its one checkpoint.
#
# 1. An engine environment with vLLM's CUDA build (.venv-gpu, or $PDMCTL_ENGINE_ENV): engine-env.sh --cuda.
# 2. The tiny Qwen3 and its data (the same build as CI's), then CI's engine tests on it with
#    model=qwen3-tiny-gpu: a PDM and a DPPO run through `pdmctl sweep --wait`, the top-K from vLLM,
#    the loss inside VeRL against pdmctl.masks, a failure injected in the rollout.
# 3. One job of the tiny Qwen3 through a single-node SLURM on this machine, where SLURM can be started
#    (root, Debian's slurm-wlm installed or installable: .ci/slurm_up.sh with REAL_GPUS=1), with
#    clusters/slurm-local-gpu.yaml: the job body a cluster run takes (Ray inside the allocation, the
#    trainer on the job's GPU, MLflow), then `pdmctl status`. Where SLURM cannot start, one line says
#    why and the step is left out (the others still count).
# 4. With QWEN3_4B_BASE_DIR: one training step of the qwen3-4b-base preset from those weights on data
#    of its own, written here: 256 two-digit sums as the training set (two batches of the preset's
#    128 prompts: VeRL drops a last partial batch, so fewer than 128 rows leave its dataloader empty)
#    and 8 held-out sums under each of the aime24/aime25 names, in VeRL's layout through
#    `pdmctl data prepare`; validation at 2 samples a problem. Then `pdmctl status`.
#
# Every step prints its time. The test suite does not run this script (its CI has no GPU): run it by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
step() { echo "== [gpu-check $((SECONDS - T0))s] $*"; }

WEIGHTS="${1:-}"
if [ -n "$WEIGHTS" ] && [ ! -f "$WEIGHTS/config.json" ]; then
  echo "gpu-check.sh: $WEIGHTS has no config.json (a Hugging Face model directory is expected)" >&2
  exit 2
fi
command -v nvidia-smi >/dev/null || { echo "gpu-check.sh: no nvidia-smi: this is not a GPU machine" >&2; exit 2; }
GPUS="$(nvidia-smi -L | grep -c '^GPU ')"
[ "$GPUS" -ge 1 ] || { echo "gpu-check.sh: nvidia-smi lists no GPU" >&2; exit 2; }
export PDMCTL_GPUS_PER_NODE="$GPUS"
nvidia-smi -L

ENV_DIR="${PDMCTL_ENGINE_ENV:-.venv-gpu}"
step "engine environment (CUDA vLLM) at $ENV_DIR"
bash scripts/engine-env.sh --cuda "$ENV_DIR"

export PDMCTL_TINY_DIR="${PDMCTL_TINY_DIR:-$PWD/.cache/qwen3-tiny}"
step "tiny Qwen3 and its data at $PDMCTL_TINY_DIR"
"$ENV_DIR/bin/python" -m pdmctl.backends.verl.tiny "$PDMCTL_TINY_DIR"

step "engine tests on the GPU (model=qwen3-tiny-gpu, $GPUS GPU(s))"
PDMCTL_ENGINE_MODEL=qwen3-tiny-gpu PDMCTL_NO_SKIPS=1 "$ENV_DIR/bin/python" -m pytest -q -rxs \
  -m "engine and not engine_long" --durations=0 tests/test_verl_engine.py

step "one job through a single-node SLURM (clusters/slurm-local-gpu.yaml)"
if [ "$(id -u)" != 0 ]; then
  echo "gpu-check.sh: not root: SLURM cannot be started here; the SLURM job is left out"
elif ! REAL_GPUS=1 timeout 600 bash .ci/slurm_up.sh; then
  echo "gpu-check.sh: .ci/slurm_up.sh failed (above): the SLURM job is left out"
else
  SWORK="$(mktemp -d /tmp/pdmctl-gpu-slurm.XXXXXX)"
  (cd "$SWORK" && "$ENV_DIR/bin/pdmctl" sweep backend=verl model=qwen3-tiny-gpu mask=pdm_agg k=5 \
     --cluster "$OLDPWD/clusters/slurm-local-gpu.yaml" --name gpu-check-slurm --wait \
   && "$ENV_DIR/bin/pdmctl" status gpu-check-slurm --cluster "$OLDPWD/clusters/slurm-local-gpu.yaml")
  grep -rh "Ray node(s) up" "$SWORK/pdmctl-runs" | head -3 || true  # the job body's own line
fi

if [ -n "$WEIGHTS" ]; then
  WORK="$(mktemp -d /tmp/pdmctl-gpu-check.XXXXXX)"
  step "data for one step of the 4B preset: 256 training sums, 8 + 8 held out ($WORK/data)"
  "$ENV_DIR/bin/python" - "$WORK" <<'PY'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
for name, rows in (("train", pairs[0::3][:256]), ("aime24", pairs[1::3][:8]), ("aime25", pairs[2::3][:8])):
    with (work / f"{name}.jsonl").open("w") as f:  # disjoint sets of distinct problems
        f.writelines(json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n" for a, b in rows)
PY
  "$ENV_DIR/bin/pdmctl" data prepare "$WORK/data" --train "$WORK/train.jsonl" --aime24 "$WORK/aime24.jsonl" \
    --aime25 "$WORK/aime25.jsonl"
  step "one step of Qwen3-4B-Base from $WEIGHTS (work directory $WORK)"
  (cd "$WORK" && "$ENV_DIR/bin/pdmctl" sweep backend=verl model=qwen3-4b-base mask=pdm_agg k=20 \
     "backend.model_path=$WEIGHTS" "backend.data_dir=$WORK/data" backend.total_training_steps=1 \
     backend.save_freq=1 backend.val_n=2 backend.nnodes=1 --name gpu-check --wait \
   && "$ENV_DIR/bin/pdmctl" status gpu-check)
fi
step "done"
