#!/usr/bin/env bash
# The CUDA engine environment's lock files: every package of scripts/engine-env.sh --cuda (or --cuda12) at one
# version, resolved from the package index (PyPI) alone for Linux x86_64 (uv's manylinux_2_28 platform) and
# Python 3.11; the nodes need the glibc its wheels need, which `--check` computes (scripts/lock_glibc.py: 2.31
# today, for both). Two locks, by the CUDA of their torch and so the NVIDIA driver the nodes need:
#   scripts/engine-cuda.lock    (from scripts/engine-cuda.in)    vLLM 0.24.0, torch 2.11.0: CUDA 13.0, driver >= 580.65.06
#   scripts/engine-cuda12.lock  (from scripts/engine-cuda12.in)  vLLM 0.19.1, torch 2.10.0: CUDA 12.8, driver >= 525.60.13
#
#   bash scripts/engine-lock.sh [--cuda12]          resolve the lock's .in file and pyproject.toml's dev, verl and
#                                                   cluster extras again, newest versions allowed, into the lock
#   bash scripts/engine-lock.sh --check [--cuda12]  CI: resolve the same inputs constrained to the lock's versions;
#                                          fails (exit 1, the resolver's reason) when they no longer resolve (a
#                                          pin yanked or gone from the index, pyproject.toml asking for something
#                                          the lock cannot give), or when the result is not the lock (a new
#                                          dependency: run the script without --check and commit the lock);
#                                          then scripts/lock_glibc.py computes the lowest glibc the lock's
#                                          wheels install on and fails (exit 1) when it is not the floor
#                                          scripts/engine-env.sh (GLIBC_FLOOR, GLIBC_FLOOR_CUDA12) and
#                                          docs/CLUSTER.md state
#
# Needs uv (pdmctl's dev venv has it), a python3 with `packaging` (an activated venv's) and network access to pypi.org;
# no GPU, no CUDA, nothing installed.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
UV="${UV:-$(command -v uv || echo "$REPO/.venv/bin/uv")}"
MODE=write
VARIANT=cuda
for arg in "$@"; do
  case "$arg" in
    --check) MODE=check ;;
    --cuda12) VARIANT=cuda12 ;;
    *) echo "engine-lock.sh: unknown option '$arg' (usage: bash scripts/engine-lock.sh [--check] [--cuda12])" >&2
       exit 2 ;;
  esac
done
IN="scripts/engine-$VARIANT.in"
LOCK="scripts/engine-$VARIANT.lock"
# scripts/engine-cuda.excludes: what the resolver leaves out of the CUDA 13 lock, and why (the CUDA 12 lock
# leaves nothing out: Transformer Engine's binding names the CUDA 12 core it uses there)
if [ "$VARIANT" = cuda ]; then
  EXCLUDES=(--excludes scripts/engine-cuda.excludes)
  COMPILE_COMMAND="bash scripts/engine-lock.sh"
else
  EXCLUDES=()
  COMPILE_COMMAND="bash scripts/engine-lock.sh --cuda12"
fi
[ -x "$UV" ] || { echo "engine-lock.sh: no uv (pip install 'uv>=0.5', or set UV=/path/to/uv)" >&2; exit 2; }

# The platform and interpreter of the cluster's engine environment (engine-env.sh --cuda and --cuda12 build on
# python3.11); uv reads no pip configuration, so the machine's own package mirrors play no part.
resolve() {
  "$UV" pip compile --quiet --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --default-index https://pypi.org/simple --custom-compile-command "$COMPILE_COMMAND" \
    ${EXCLUDES[@]+"${EXCLUDES[@]}"} "$IN" pyproject.toml --extra dev --extra verl --extra cluster "$@"
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
  echo "engine-lock.sh: $LOCK is not what its inputs resolve to (< lock, > now): run $COMPILE_COMMAND" >&2
  exit 1
fi
echo "engine-lock.sh: $LOCK resolves ($(pins "$LOCK" | wc -l) packages, Linux x86_64, Python 3.11) in $(( $(date +%s) - start )) s"
python3 scripts/lock_glibc.py "--$VARIANT"
