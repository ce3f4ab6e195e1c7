#!/usr/bin/env bash
# pdmctl installed from a wheel, as a user installs it: the wheel is built from a clean clone of this
# checkout's HEAD, installed in a fresh virtualenv (no [dev]), and run from an empty folder, where the
# config tree, sweep files and cluster profiles can only come from the package's own data.
#   bash scripts/ci-wheel.sh [WORK]   (WORK: a scratch folder, default a new one under /tmp)
set -euo pipefail
# --no-compile: pip compiles every installed file's bytecode at install otherwise (torch's and MLflow's:
# minutes of CPU here); Python writes what the commands below import, at their first import
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# the login node's environment: `du -sm` of the virtualenv right after `pip install --no-compile` of the wheel
# without extras: 190 MB, MLflow's skinny client without the report's scipy and matplotlib (the [report] extra,
# 197 MB more) and without the full mlflow, whose server brings pyarrow, pandas and scikit-learn (the [server]
# extra, 525 MB more). The limit fails the run where one of them, or another package of their size, comes back.
LOGIN_NODE_MAX_MB=250
WORK="${1:-$(mktemp -d /tmp/pdmctl-wheel.XXXXXX)}"
mkdir -p "$WORK"
rm -rf "$WORK/clone" "$WORK/dist" "$WORK/proj" "$WORK/empty"
git clone -q "$ROOT" "$WORK/clone"
# the virtualenv inside a user's own git project, as many keep it (myproj/.venv): pdmctl must name the commit
# its wheel was built from, never the project's
git init -q "$WORK/proj"
git -C "$WORK/proj" -c user.name=ci -c user.email=ci@localhost commit -q --allow-empty -m "a user's project"
python3 -m venv "$WORK/proj/.venv"
"$WORK/proj/.venv/bin/pip" install -q --upgrade pip
"$WORK/proj/.venv/bin/pip" wheel -q --no-deps -w "$WORK/dist" "$WORK/clone"
# first without PyTorch, as a login node that only plans and submits has it: the dry runs work, a testbed
# run is refused in one line naming the extra
"$WORK/proj/.venv/bin/pip" install -q --no-compile "$WORK"/dist/pdmctl-*.whl
LOGIN_NODE_MB="$(du -sm "$WORK/proj/.venv" | cut -f1)"
echo "ci-wheel: the login node's environment (pip install pdmctl, no extras): ${LOGIN_NODE_MB} MB (limit ${LOGIN_NODE_MAX_MB} MB)"
if [ "$LOGIN_NODE_MB" -gt "$LOGIN_NODE_MAX_MB" ]; then
  echo "ci-wheel: the login node's environment is over ${LOGIN_NODE_MAX_MB} MB; its largest packages:"
  du -sm "$WORK"/proj/.venv/lib/python3*/site-packages/* | sort -rn | head -15
  exit 1
fi
mkdir "$WORK/empty"
cd "$WORK/empty"
export PATH="$WORK/proj/.venv/bin:$PATH"
pdmctl --version | tee version.txt
grep -q "(commit $(git -C "$WORK/clone" rev-parse HEAD | cut -c1-12))" version.txt || { cat version.txt; exit 1; }
! python -c "import torch" 2>/dev/null
pdmctl sweep delta=0.05 --dry-run
pdmctl sweep --file smoke --cluster local --dry-run >/dev/null
set +e
pdmctl sweep backend.steps=1 >refused.txt 2>&1
REFUSED=$?
set -e
[ "$REFUSED" = 2 ] && grep -q "pip install 'pdmctl\[testbed\]'" refused.txt || { cat refused.txt; exit 1; }
# the report's statistics and figures are the [report] extra: refused in one line naming it, exit 2
set +e
pdmctl report >refused.txt 2>&1
REFUSED=$?
set -e
[ "$REFUSED" = 2 ] && [ "$(wc -l <refused.txt)" = 1 ] && grep -q "pip install 'pdmctl\[report\]'" refused.txt \
  || { cat refused.txt; exit 1; }
test ! -e mlflow.db
pip install -q --no-compile torch==2.13.0 "$(ls "$WORK"/dist/pdmctl-*.whl)[testbed]"
pdmctl init "$WORK/empty/copy"
test -f "$WORK/empty/copy/configs/run.yaml"
test ! -e "$WORK/empty/mlflow.db"  # a dry run writes nothing
# the README's quickstart as written (its sweep, then its report), from the installed package: the
# comparison needs the package's report definition and templates
read -r -a SWEEP_CMD <<<"$(python3 - "$WORK/clone/README.md" sweep <<'PY'
import sys
text = open(sys.argv[1]).read().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
line = next(line for line in text.splitlines() if "pdmctl sweep" in line)
print(next(part.strip() for part in line.split("&&") if part.strip().startswith(f"pdmctl {sys.argv[2]}")))
PY
)"
read -r -a REPORT_CMD <<<"$(python3 - "$WORK/clone/README.md" report <<'PY'
import sys
text = open(sys.argv[1]).read().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
line = next(line for line in text.splitlines() if "pdmctl sweep" in line)
print(next(part.strip() for part in line.split("&&") if part.strip().startswith(f"pdmctl {sys.argv[2]}")))
PY
)"
echo "the README's quickstart: ${SWEEP_CMD[*]} && ${REPORT_CMD[*]}"
"${SWEEP_CMD[@]}"
pdmctl status | tee status.txt | grep "6 finished" >/dev/null || { cat status.txt; exit 1; }
"${REPORT_CMD[@]}" | tee report.txt | grep "vs dppo_topk_kl" >/dev/null || { cat report.txt; exit 1; }
grep "paired" report.txt >/dev/null
test -f reports/default/index.html
echo "ci-wheel: the wheel installs and runs from an empty folder"
