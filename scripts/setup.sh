#!/usr/bin/env bash
# Everything the project needs, idempotent: the package environment (scripts/setup_env.sh:
# .venv, torch, the extension), what the tests need (scripts/setup_tests.sh: pytest, the
# optional dependencies, mypy; scripts/setup_slurm.sh: SLURM through apt-get when root), and
# the xla environment (scripts/setup_xla.sh: .venv-xla, ~7 GB; SKIP_XLA=1 skips it).
# scripts/demo.sh runs only setup_env.sh; scripts/test.sh runs this with SKIP_XLA=1 and the
# xla set-up beside the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."

# SLURM's packages install beside the Python environments (apt and dpkg against pip's
# downloads and the extension's compilation: they share no files), instead of after them:
# on a fresh 2-core machine that takes its half minute or so off the set-up. Its output is
# printed when it ends.
mkdir -p build
slurm_log=build/slurm-setup.log
bash scripts/setup_slurm.sh > "$slurm_log" 2>&1 &
slurm_job=$!
finish_slurm() {
  local status=0
  wait "$slurm_job" || status=$?
  cat "$slurm_log"
  return "$status"
}
# If the Python set-up fails, apt is still waited for: a dpkg stopped half-way leaves the
# machine's package database for an administrator to mend.
trap 'wait "$slurm_job" 2>/dev/null || true' EXIT

bash scripts/setup_env.sh
SKIP_SLURM=1 bash scripts/setup_tests.sh
finish_slurm
trap - EXIT
if [ "${SKIP_XLA:-0}" != 1 ]; then
  bash scripts/setup_xla.sh
fi
