#!/usr/bin/env bash
# What the test suite needs beyond the package environment (scripts/setup_env.sh), idempotent:
# - into .venv: pytest and its plugins, the optional dependencies the library supports and
#   the suite exercises (Lightning, torchmetrics, safetensors, cloudpickle), mypy, matplotlib;
# - on the machine, as root with apt-get: SLURM (slurmctld, slurmd, slurm-client, munge), for
#   the tests that start a private one-node cluster. Without root or apt-get those tests
#   skip, saying so; a failing apt-get never fails the set-up.
# scripts/test.sh runs it (through scripts/setup.sh); scripts/demo.sh does not.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY="$VENV/bin/python"
STAMP=$VENV/.torchstrategy-tests
if [ ! -x "$PY" ]; then
  echo "setup_tests.sh: no $PY; run scripts/setup_env.sh first" >&2
  exit 1
fi

want_deps="pytest pytest-timeout pytest-xdist cloudpickle"
# Lightning adapter (torchstrategy.lightning): both package names Lightning ships under.
want_deps="$want_deps lightning pytorch-lightning torchmetrics"
# The type checker scripts/test.sh runs over torchstrategy/ ([tool.mypy] in pyproject.toml).
want_deps="$want_deps mypy"
# Plots of scripts/convergence_compression.py (docs/images/).
want_deps="$want_deps matplotlib"
# safetensors files for ts.load_pretrained (an optional dependency of the library).
want_deps="$want_deps safetensors"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want_deps" ]; then
  # torch is pinned in setup_env.sh; this keeps pip from replacing it.
  "$PY" -m pip install -q $want_deps "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  echo "$want_deps" > "$STAMP"
fi

# The tests' bytecode (their helpers and scripts are imported by every process a test
# starts), for the reason scripts/setup_env.sh writes the package's.
"$PY" -m compileall -q -j 0 tests >/dev/null

# SLURM daemons and client, for tests that start a private one-node cluster.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! command -v slurmctld >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends slurmctld slurmd slurm-client munge; } \
      || echo "setup_tests.sh: apt-get could not install SLURM; the SLURM tests will skip"
  fi
else
  echo "setup_tests.sh: not root or no apt-get; SLURM not installed, the SLURM tests will skip"
fi
