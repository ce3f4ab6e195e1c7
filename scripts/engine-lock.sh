#!/usr/bin/env bash
# The CUDA engine environment's lock file: every package of scripts/engine-env.sh --cuda at one version,
# resolved from the package index (PyPI) alone for Linux x86_64 (uv's manylinux_2_28 platform) and Python 3.11;
# the nodes need the glibc its wheels need, which `--check` computes (scripts/lock_glibc.py: 2.31 today).
#
#   bash scripts/engine-lock.sh            resolve scripts/engine-cuda.in and pyproject.toml's dev, verl and
#                                          cluster extras again, newest versions allowed, into
#                                          scripts/engine-cuda.lock
#   bash scripts/engine-lock.sh --check    CI: resolve the same inputs constrained to the lock's versions; fails
#                                          (exit 1, the resolver's reason) when they no longer resolve (a pin
#                                          yanked or gone from the index, pyproject.toml asking for something the
#                                          lock cannot give), or when the result is not the lock (a new
#                                          dependency: run the script without --check and commit the lock);
#                                          then scripts/lock_glibc.py computes the lowest glibc the lock's
#                                          wheels install on and fails (exit 1) when it is not the floor
#                                          scripts/engine-env.sh (GLIBC_FLOOR) and docs/CLUSTER.md state
#
# Needs uv (pdmctl's dev venv has it), a python3 with `packaging` (an activated venv's) and network access to pypi.org;
# no GPU, no CUDA, nothing installed.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
IN=scripts/engine-cuda.in
LOCK=scripts/engine-cuda.lock
UV="${UV:-$(command -v uv || echo "$REPO/.venv/bin/uv")}"
MODE=write
case "${1:-}" in
  "") ;;
  --check) MODE=check ;;
  *) echo "engine-lock.sh: unknown option '$1' (usage: bash scripts/engine-lock.sh [--check])" >&2; exit 2 ;;
esac
[ -x "$UV" ] || { echo "engine-lock.sh: no uv (pip install 'uv>=0.5', or set UV=/path/to/uv)" >&2; exit 2; }

# scripts/engine-cuda.excludes: what the resolver leaves out, and why. The platform and interpreter of the cluster's engine environment (engine-env.sh --cuda builds on
# python3.11); uv reads no pip configuration, so the machine's own package mirrors play no part.
resolve() {
  "$UV" pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --default-index https://pypi.org/simple --custom-compile-command "bash scripts/engine-lock.sh" \
    --excludes scripts/engine-cuda.excludes "$IN" pyproject.toml --extra dev --extra verl --extra cluster "$@"
}
pins() { grep -E '^[A-Za-z0-9]' "$1" | sort; }

start=$(date +%s)
if [ "$MODE" = write ]; then
  # the lock as it is seeds the output: uv keeps its versions where they still resolve (a new dependency
  # adds its packages and moves nothing else; `rm` the lock first for the newest of everything)
  [ -f "$LOCK" ] && cp "$LOCK" "$LOCK.tmp"
  resolve -o "$LOCK.tmp"
  mv "$LOCK.tmp" "$LOCK"
  echo "engine-lock.sh: $LOCK written: $(pins "$LOCK" | wc -l) packages, $(( $(date +%s) - start )) s"
  exit 0
fi

OUT="$(mktemp)"
trap 'rm -f "$OUT"' EXIT
if ! resolve -c "$LOCK" -o "$OUT"; then
  echo "engine-lock.sh: $LOCK no longer resolves from the index (above)" >&2
  exit 1
fi
if ! diff <(pins "$LOCK") <(pins "$OUT") >&2; then
  echo "engine-lock.sh: $LOCK is not what its inputs resolve to (< lock, > now): run bash scripts/engine-lock.sh" >&2
  exit 1
fi
echo "engine-lock.sh: $LOCK resolves ($(pins "$LOCK" | wc -l) packages, Linux x86_64, Python 3.11) in $(( $(date +%s) - start )) s"
python3 scripts/lock_glibc.py
