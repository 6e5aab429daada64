#!/usr/bin/env bash
# Everything the project needs, idempotent: the package environment (scripts/setup_env.sh:
# .venv, torch, the extension), what the tests need (scripts/setup_tests.sh: pytest, the
# optional dependencies, mypy, and SLURM through apt-get when root), and the xla environment
# (scripts/setup_xla.sh: .venv-xla, ~7 GB; SKIP_XLA=1 skips it).
# scripts/demo.sh runs only setup_env.sh; scripts/test.sh runs this with SKIP_XLA=1 and the
# xla set-up beside the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_tests.sh
if [ "${SKIP_XLA:-0}" != 1 ]; then
  bash scripts/setup_xla.sh
fi
