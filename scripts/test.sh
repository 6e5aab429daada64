#!/usr/bin/env bash
# Set-up (idempotent), then the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
# Bound every collective in the suite: a bug fails fast instead of hanging CI.
export TORCHSTRATEGY_TIMEOUT_SECONDS=${TORCHSTRATEGY_TIMEOUT_SECONDS:-120}
exec .venv/bin/python -m pytest -q "$@"
