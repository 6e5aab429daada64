#!/usr/bin/env bash
# Set-up (idempotent), then the quickstart: a convnet trained on scikit-learn's digits with
# MirroredStrategy (every GPU, or 2 CPU replicas). Extra arguments go to the example,
# e.g. `bash scripts/demo.sh --replicas 4 --epochs 3`.
set -euo pipefail
cd "$(dirname "$0")/.."
# The demo needs only the main environment, not the 7 GB torch_xla one.
SKIP_XLA=1 bash scripts/setup.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python examples/quickstart.py "$@"
