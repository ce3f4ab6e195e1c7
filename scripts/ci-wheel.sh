#!/usr/bin/env bash
# pdmctl installed from a wheel, as a user installs it: the wheel is built from a clean clone of this
# checkout's HEAD, installed in a fresh virtualenv (no [dev]), and run from an empty folder, where the
# config tree, sweep files and cluster profiles can only come from the package's own data.
#   bash scripts/ci-wheel.sh [WORK]   (WORK: a scratch folder, default a new one under /tmp)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d /tmp/pdmctl-wheel.XXXXXX)}"
mkdir -p "$WORK"
rm -rf "$WORK/clone" "$WORK/dist" "$WORK/venv" "$WORK/empty"
git clone -q "$ROOT" "$WORK/clone"
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q --upgrade pip
"$WORK/venv/bin/pip" wheel -q --no-deps -w "$WORK/dist" "$WORK/clone"
"$WORK/venv/bin/pip" install -q torch==2.13.0 "$WORK"/dist/pdmctl-*.whl
mkdir "$WORK/empty"
cd "$WORK/empty"
export PATH="$WORK/venv/bin:$PATH"
pdmctl --version
pdmctl sweep delta=0.05 --dry-run
pdmctl sweep --file smoke --cluster local --dry-run >/dev/null
pdmctl init "$WORK/empty/copy"
test -f "$WORK/empty/copy/configs/run.yaml"
test ! -e "$WORK/empty/mlflow.db"  # a dry run writes nothing
# a real sweep from the installed package: two masks x two seeds of the testbed at a few steps, then its
# status and report (the comparison needs the package's report definition and templates)
pdmctl sweep mask=pdm_agg,dppo_topk_kl seeds=2 backend.steps=4 backend.eval_every=2 backend.checkpoint_every=2 \
  backend.prompts_per_step=16 --wait
pdmctl status | grep "4 finished" >/dev/null
pdmctl report | grep "vs dppo_topk_kl" >/dev/null
test -f reports/default/index.html
echo "ci-wheel: the wheel installs and runs from an empty folder"
