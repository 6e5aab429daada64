#!/usr/bin/env bash
# The GPU proof in one command (issue 37): build the extension for the GPU (sm_90), run the
# CUDA tests, then the GPU benchmarks; the report (report.md, report.json) goes to
# $OUT/gpu_report, else build/gpu_report (or --out DIR). Every part has its own time limit,
# the whole run at most --budget seconds (480). See scripts/gpu_check.py or --help.
#
#   bash scripts/gpu_check.sh               # on the GPU machine: its own python3 and torch
#   bash scripts/gpu_check.sh --dry-run     # every part and its command
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh --no-cuda   # the CPU-only path here
#
# The python is $PYTHON, else python3 (the GPU machine's, not this repository's .venv).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
exec "$PYTHON" scripts/gpu_check.py --python "$PYTHON" "$@"
