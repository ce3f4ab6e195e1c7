#!/usr/bin/env bash
# The multi-node part of CI: start the 2-node SLURM (.ci/slurm_multi_up.sh), run the tests marked
# `multinode` (tests/test_slurm_multinode.py: srun across both nodes, a toy sweep through
# clusters/slurm-multi.yaml, a node lost mid-run), and tear the cluster down whatever happened.
# Prints each step's time. Needs root (namespaces, daemons). The single-node SLURM of
# .ci/slurm_up.sh is left alone and may run at the same time.
#
#   bash scripts/ci-multinode.sh          (Python: $PYTHON, else ./.venv/bin/python, else the active one)
#   bash scripts/ci-multinode.sh --all    (also a node lost mid-run: about 2 more minutes, timing-dependent)
#   KEEP_CLUSTER=1 bash scripts/ci-multinode.sh   (leave the cluster up afterwards)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then  # the project's environment: .venv if there, else the active one
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=$(command -v python); fi
fi
T0=$(date +%s.%N)
step() { awk -v a="$T0" -v b="$(date +%s.%N)" -v m="$*" 'BEGIN{printf "== [multinode %6.1fs] %s\n", b-a, m}'; }
down() {
  if [ "${KEEP_CLUSTER:-0}" = 1 ]; then step "cluster left up (KEEP_CLUSTER=1)"; return; fi
  step "tearing the 2-node cluster down"
  timeout 120 bash .ci/slurm_multi_down.sh
  step "cluster down"
}
step "starting the 2-node cluster"
if ! timeout 300 bash .ci/slurm_multi_up.sh; then
  step "cluster start FAILED"
  down
  exit 1
fi
step "cluster up; tests (-m multinode)"
# -m replaces pyproject's `-m 'not engine and not multinode'`; a skip would mean the cluster is not there
SELECT=(-k "not losing_a_node")
[ "${1:-}" = "--all" ] && SELECT=()
SLURM_CONF=/etc/slurm-pdm-multi/slurm.conf timeout 1500 "$PYTHON" -m pytest -q -m multinode -rs --durations=0 \
  -p no:cacheprovider "${SELECT[@]}" tests/test_slurm_multinode.py
rc=$?
step "tests done (exit $rc)"
down
step "done (exit $rc)"
exit $rc
