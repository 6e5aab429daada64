#!/usr/bin/env bash
# The package environment (scripts/setup_env.sh, idempotent: .venv, torch, the extension;
# nothing installed outside the clone and its .venv), then the quickstart: a convnet trained
# on scikit-learn's digits with MirroredStrategy (every GPU, or 2 CPU replicas). Extra
# arguments go to the example, e.g. `bash scripts/demo.sh --replicas 4 --epochs 3`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PYTHONUNBUFFERED=1
exec .venv/bin/python examples/quickstart.py "$@"
