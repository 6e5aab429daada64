#!/usr/bin/env bash
# What the test suite needs beyond the package environment (scripts/setup_env.sh), idempotent:
# - into .venv: pytest and its plugins, the optional dependencies the library supports and
#   the suite exercises (Lightning, torchmetrics, safetensors, cloudpickle), mypy, matplotlib;
# - on the machine, as root with apt-get: SLURM (scripts/setup_slurm.sh: slurmctld, slurmd,
#   slurm-client, munge), for the tests that start a private cluster. Without root or
#   apt-get those tests skip, saying so; a failing apt-get never fails the set-up.
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

# SLURM's daemons and client (scripts/setup_slurm.sh), unless the caller runs that itself:
# scripts/setup.sh does, beside the environments' set-up (SKIP_SLURM=1 here).
if [ "${SKIP_SLURM:-0}" != 1 ]; then
  bash scripts/setup_slurm.sh
fi
