#!/usr/bin/env bash
# The first GPU session in one command: the engine checks CI runs on CPU, run on a GPU with CUDA vLLM.
#
#   bash scripts/gpu-check.sh [QWEN3_4B_BASE_DIR]
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
# 4. With QWEN3_4B_BASE_DIR (a local copy of Qwen/Qwen3-4B-Base; the machine may have no hub): one
#    training step of the qwen3-4b-base preset from those weights, on the tiny data (its prompts are
#    text; the 4B model's own tokenizer reads them), through `pdmctl sweep --wait`, then `pdmctl status`.
#
# Every step prints its time. Nothing here has run yet: no GPU has been available to this project.
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
bash scripts/engine-env.sh "$ENV_DIR" --cuda

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
  step "one step of Qwen3-4B-Base from $WEIGHTS (work directory $WORK)"
  (cd "$WORK" && "$ENV_DIR/bin/pdmctl" sweep backend=verl model=qwen3-4b-base mask=pdm_agg k=20 \
     "backend.model_path=$WEIGHTS" "backend.data_dir=$PDMCTL_TINY_DIR/data" backend.total_training_steps=1 \
     backend.save_freq=1 backend.nnodes=1 --name gpu-check --wait \
   && "$ENV_DIR/bin/pdmctl" status gpu-check)
fi
step "done"
