#!/usr/bin/env bash
# Set-up (idempotent), then the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
# Types first: a wrong annotation fails the run before the slow suite starts.
.venv/bin/python -m mypy torchstrategy
# Bound every collective in the suite: a bug fails fast instead of hanging CI.
export TORCHSTRATEGY_TIMEOUT_SECONDS=${TORCHSTRATEGY_TIMEOUT_SECONDS:-120}
.venv/bin/python -m pytest -q "$@"
# TPUStrategy's suite, in the xla environment on 4 XLA:CPU devices (after the main suite).
if [ "${SKIP_XLA:-0}" != 1 ]; then
  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python -m pytest -q tests/xla
fi
