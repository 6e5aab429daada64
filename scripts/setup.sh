#!/usr/bin/env bash
# Idempotent set-up: a .venv with torch 2.13.0 (CPU wheel on these machines), the test and
# example dependencies, and torchstrategy built in place with its C++ extension.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.torchstrategy-setup

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Pin torch first and on its own: anything that depends on torch then sees it satisfied and
# never pulls the multi-GB CUDA build.
want_deps="torch==2.13.0 numpy pytest pytest-timeout pytest-xdist tqdm scikit-learn setuptools wheel ninja cloudpickle"
# Lightning adapter (torchstrategy.lightning): both package names Lightning ships under.
want_deps="$want_deps lightning pytorch-lightning torchmetrics"
# The type checker scripts/test.sh runs over torchstrategy/ ([tool.mypy] in pyproject.toml).
want_deps="$want_deps mypy"
# Plots of scripts/convergence_compression.py (docs/images/).
want_deps="$want_deps matplotlib"
# safetensors files for ts.load_pretrained (an optional dependency of the library).
want_deps="$want_deps safetensors"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want_deps" ]; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q $want_deps
  echo "$want_deps" > "$STAMP"
fi

# Rebuild the extension only when a C++/CUDA source or the build script changed.
build_stamp=$VENV/.torchstrategy-build
sources_hash=$(cat setup.py setup.cfg pyproject.toml csrc/* 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ ! -f "$build_stamp" ] || [ "$(cat "$build_stamp")" != "$sources_hash" ] \
   || ! "$PY" -c "import torchstrategy._C" 2>/dev/null; then
  MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  echo "$sources_hash" > "$build_stamp"
fi

# SLURM daemons and client, for tests that start a private one-node cluster: only where
# root and apt-get are available; a failure here never fails set-up (those tests skip).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! command -v slurmctld >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends slurmctld slurmd slurm-client munge; } \
      || echo "setup.sh: apt-get could not install SLURM; the SLURM tests will skip"
  fi
else
  echo "setup.sh: not root or no apt-get; SLURM not installed, the SLURM tests will skip"
fi

# The xla environment (TPUStrategy on XLA:CPU, its own venv): scripts/setup_xla.sh.
# SKIP_XLA=1 skips it.
if [ "${SKIP_XLA:-0}" != 1 ]; then
  bash scripts/setup_xla.sh
fi
