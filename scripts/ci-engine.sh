#!/usr/bin/env bash
# The engine part of CI: build the engine environment (VeRL 0.9.1 + vLLM's CPU build + this project),
# build the tiny Qwen3 once, run the engine tests with the engine environment's Python.
#
#   bash scripts/ci-engine.sh            (from .ci/run, after SLURM and the MLflow server are up)
#   bash scripts/ci-engine.sh --all      (also kill -9 and resume, which starts the engine twice)
#
# PDMCTL_ENGINE_ENV: where the environment lives (default .venv-engine; reused and repaired if there).
# PDMCTL_ENGINE_ENV_BUILT=1: it is built already (.ci/run builds it in the background), do not check it again.
set -euo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
step() { echo "== [engine $((SECONDS - T0))s] $*"; }

ENV_DIR="${PDMCTL_ENGINE_ENV:-.venv-engine}"
if [ "${PDMCTL_ENGINE_ENV_BUILT:-0}" = 1 ]; then  # .ci/run built it (and the tiny Qwen3) in the background
  step "engine environment at $ENV_DIR (built already)"
else
  step "engine environment at $ENV_DIR"
  bash scripts/engine-env.sh "$ENV_DIR"
fi

export PDMCTL_TINY_DIR="${PDMCTL_TINY_DIR:-$PWD/.cache/qwen3-tiny}"
step "tiny Qwen3 and its data at $PDMCTL_TINY_DIR"
"$ENV_DIR/bin/python" -m pdmctl.backends.verl.tiny "$PDMCTL_TINY_DIR"

MARK="engine and not engine_long"
[ "${1:-}" = "--all" ] && MARK="engine"
# PDMCTL_ENGINE_MARK: a part of them (CI runs those off the one-node SLURM first, `and not cluster`, and the
# SLURM one once the suite's SLURM lane has ended, `and cluster`)
MARK="${PDMCTL_ENGINE_MARK:-$MARK}"
step "engine tests (-m '$MARK')"
# -m replaces pyproject's `-m "not engine"`; a skip fails (everything is installed above)
PDMCTL_NO_SKIPS=1 "$ENV_DIR/bin/python" -m pytest -q -m "$MARK" --durations=0 tests/test_verl_engine.py
step "done"
