#!/usr/bin/env bash
# The tests, as the README and CI run them: three pytest processes side by side on the same selection as
# `python -m pytest -q` (pyproject's: everything but the engine's and the 2-node cluster's tests).
#
#   lane "cluster": the tests that use the one-node SLURM (`-m cluster`, set by tests/conftest.py), one at
#                   a time: they share its queue and slots, and some assert what runs when;
#   lane "testbed": the testbed's, the analysis's and tune's test files (CPU-bound, self-contained), once the
#                   cluster lane or the rest lane has ended, unless the command names files of its own;
#   lane "rest":    everything else, beside them.
#
# Most of the cluster lane's time is spent waiting on SLURM and on jobs, and one pytest process keeps one
# core at most busy: the third lane fills the second. Arguments go to every pytest process (e.g.
# `bash scripts/test.sh --durations=20`, `-x`, a file: a lane that selects nothing is not a failure).
# The rest lane prints as it goes; the others' output follows when all are done. Exit status:
# the first lane's failure, else 0. Python: $PYTHON, else ./.venv/bin/python if there, else `python`.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=$(command -v python || command -v python3); fi
fi
# Three processes on the cores: each with one intra-op thread, unless the caller says otherwise (the tests' torch
# work is small ops; a process's second thread, waiting for a core, holds the first at each op's end)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
BASE="not engine and not multinode and not multinode_engine"  # pyproject's addopts; -m below replaces it
LOG="$(mktemp /tmp/pdmctl-tests-cluster.XXXXXX)"
CLUSTER_PID=""
trap '[ -n "$CLUSTER_PID" ] && kill "$CLUSTER_PID" 2>/dev/null; rm -f "$LOG" "$LOG.rc" "$LOG.rest"' EXIT
trap 'exit 130' INT TERM
T0=$SECONDS

# PDMCTL_CLUSTER_LANE_DONE=FILE: the cluster lane's exit status is written to FILE when it ends (CI
# starts the engine's tests then, on the one-node SLURM the lane no longer uses)
( "$PYTHON" -m pytest -m "cluster and ($BASE)" -p no:cacheprovider "$@" >"$LOG" 2>&1 & p=$!
  trap 'kill "$p" 2>/dev/null' TERM
  wait "$p"; rc=$?
  echo "$rc" >"$LOG.rc"
  [ -n "${PDMCTL_CLUSTER_LANE_DONE:-}" ] && echo "$rc" >"$PDMCTL_CLUSTER_LANE_DONE"; exit "$rc" ) &
CLUSTER_PID=$!
# lane "testbed": the testbed's, the analysis's and tune's files (CPU-bound, self-contained: their own working
# folders and caches), in a third process, unless the command names files of its own
TESTBED_FILES=(tests/test_tune.py tests/test_seeds.py tests/test_counterfactual.py tests/test_analysis_inference.py
               tests/test_toy_*.py)
NAMED=0
for arg in "$@"; do case "$arg" in tests/*|*/tests/*|*.py|*::*) NAMED=1 ;; esac; done
TESTBED_PID=""
IGNORE=()
if [ "$NAMED" = 0 ]; then
  LOG_B="$(mktemp /tmp/pdmctl-tests-testbed.XXXXXX)"
  trap '[ -n "$CLUSTER_PID" ] && kill "$CLUSTER_PID" 2>/dev/null; [ -n "$TESTBED_PID" ] && kill "$TESTBED_PID" 2>/dev/null; rm -f "$LOG" "$LOG.rc" "$LOG.rest" "$LOG_B"' EXIT
  # it starts when the cluster lane or the rest lane has ended: three processes at most at a time, as before,
  # and no core idle while one lane runs alone
  ( while [ ! -s "$LOG.rc" ] && [ ! -e "$LOG.rest" ]; do sleep 2; done
    exec "$PYTHON" -m pytest -m "not cluster and ($BASE)" -p no:cacheprovider "$@" "${TESTBED_FILES[@]}" ) >"$LOG_B" 2>&1 &
  TESTBED_PID=$!
  for f in "${TESTBED_FILES[@]}"; do IGNORE+=("--ignore=$f"); done
  echo "== tests: lanes 'cluster' (the one-node SLURM's tests, one at a time) and, once it or 'rest' has ended, 'testbed' (${#TESTBED_FILES[@]} files) in the background; lane 'rest' here"
else
  echo "== tests: lane 'cluster' (the one-node SLURM's tests, one at a time) in the background; lane 'rest' here"
fi
"$PYTHON" -m pytest -m "not cluster and ($BASE)" "$@" "${IGNORE[@]}"
rest=$?
touch "$LOG.rest"  # the testbed lane starts now if it has not
echo "== lane 'rest' done in $((SECONDS - T0)) s (exit $rest)"
testbed=5
if [ -n "$TESTBED_PID" ]; then
  wait "$TESTBED_PID"
  testbed=$?
  TESTBED_PID=""
  echo "== lane 'testbed' done in $((SECONDS - T0)) s (exit $testbed); its output:"
  cat "$LOG_B"
fi
wait "$CLUSTER_PID"
cluster=$?
CLUSTER_PID=""
echo "== lane 'cluster' done in $((SECONDS - T0)) s (exit $cluster); its output:"
cat "$LOG"
# 5: pytest selected nothing in that lane (a file of one lane only); a failure only when every lane selected nothing
if [ "$rest" = 5 ] && [ "$testbed" = 5 ] && [ "$cluster" = 5 ]; then exit 5; fi
for rc in "$rest" "$testbed" "$cluster"; do
  [ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"
done
exit 0
