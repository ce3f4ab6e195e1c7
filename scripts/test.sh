#!/usr/bin/env bash
# The tests, as the README and CI run them: two pytest processes side by side on the same selection as
# `python -m pytest -q` (pyproject's: everything but the engine's and the 2-node cluster's tests).
#
#   lane "cluster": the tests that use the one-node SLURM (`-m cluster`, set by tests/conftest.py), one at
#                   a time: they share its queue and slots, and some assert what runs when;
#   lane "rest":    everything else, beside it.
#
# Most of the cluster lane's time is spent waiting on SLURM and on jobs, so on 2 cores the two lanes
# together take about two thirds of one process's time. Arguments go to both pytest processes
# (e.g. `bash scripts/test.sh --durations=20`, `-x`, a file: a lane that selects nothing is not a failure).
# The rest lane prints as it goes; the cluster lane's output follows when both are done. Exit status:
# the first lane's failure, else 0. Python: $PYTHON, else ./.venv/bin/python if there, else `python`.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=$(command -v python || command -v python3); fi
fi
BASE="not engine and not multinode and not multinode_engine"  # pyproject's addopts; -m below replaces it
LOG="$(mktemp /tmp/pdmctl-tests-cluster.XXXXXX)"
CLUSTER_PID=""
trap '[ -n "$CLUSTER_PID" ] && kill "$CLUSTER_PID" 2>/dev/null; rm -f "$LOG"' EXIT
trap 'exit 130' INT TERM
T0=$SECONDS

# PDMCTL_CLUSTER_LANE_DONE=FILE: the cluster lane's exit status is written to FILE when it ends (CI
# starts the engine's tests then, on the one-node SLURM the lane no longer uses)
( "$PYTHON" -m pytest -m "cluster and ($BASE)" -p no:cacheprovider "$@" >"$LOG" 2>&1 & p=$!
  trap 'kill "$p" 2>/dev/null' TERM
  wait "$p"; rc=$?
  [ -n "${PDMCTL_CLUSTER_LANE_DONE:-}" ] && echo "$rc" >"$PDMCTL_CLUSTER_LANE_DONE"; exit "$rc" ) &
CLUSTER_PID=$!
echo "== tests: lane 'cluster' (the one-node SLURM's tests, one at a time) in the background; lane 'rest' here"
"$PYTHON" -m pytest -m "not cluster and ($BASE)" "$@"
rest=$?
echo "== lane 'rest' done in $((SECONDS - T0)) s (exit $rest); waiting for lane 'cluster'"
wait "$CLUSTER_PID"
cluster=$?
CLUSTER_PID=""
echo "== lane 'cluster' done in $((SECONDS - T0)) s (exit $cluster); its output:"
cat "$LOG"
# 5: pytest selected nothing in that lane (a file of one lane only); a failure only when both selected nothing
[ "$rest" = 5 ] && [ "$cluster" != 5 ] && rest=0
[ "$cluster" = 5 ] && [ "$rest" = 0 ] && cluster=0
[ "$rest" != 0 ] && exit "$rest"
exit "$cluster"
