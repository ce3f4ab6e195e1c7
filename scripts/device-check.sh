#!/usr/bin/env bash
# The device check: the masks on a GPU against their CPU path, their cost at the paper's
# scale (ratios to one log_softmax and to DPPO), the fused Triton kernel beside the torch path, and
# the toy testbed trained a few steps on the GPU. bench/device_check.py says what each part checks.
#
#   bash scripts/device-check.sh OUT_DIR          a CUDA machine: about 5 minutes on one H200
#   bash scripts/device-check.sh OUT_DIR --cpu    the CPU half at small sizes (CI runs it)
#
# Needs only python3 with torch and numpy (and Triton, for the fused kernel): no network, nothing
# installed; pdmctl comes from this working tree by PYTHONPATH. $PYTHON picks the interpreter
# (python3 by default). Writes OUT_DIR/device-check.json and OUT_DIR/device-check.txt (each section as
# it finishes); exit 0 when every check passed, 1 when one failed, 2 on bad input; stopped after
# 470 s whatever happens (the machine it was written for is lent for minutes).
set -euo pipefail
USAGE="usage: bash scripts/device-check.sh OUT_DIR [--cpu]"
if [ $# -lt 1 ] || [ $# -gt 2 ] || [ -z "$1" ] || { [ $# -eq 2 ] && [ "$2" != --cpu ]; }; then
  echo "device-check.sh: $USAGE" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "device-check.sh: no $PY here (set PYTHON)" >&2; exit 2; }
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 470 "$PY" "$ROOT/bench/device_check.py" "$@"
