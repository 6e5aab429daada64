#!/usr/bin/env bash
# Set-up (idempotent), then the whole test suite. Extra arguments go to the main suite's
# pytest (e.g. `-n 0` to run it in one process, or a path).
#
# The set-up is scripts/setup.sh without the xla environment: the package environment
# (scripts/setup_env.sh) and what only the tests need (scripts/setup_tests.sh: pytest, the
# optional dependencies, mypy, and SLURM's daemons through apt-get when run as root).
set -euo pipefail
cd "$(dirname "$0")/.."

SKIP_XLA=1 bash scripts/setup.sh

# The xla environment (~7 GB of wheels, mostly download and disk) is installed in the
# background while the main suite keeps the CPUs busy; its output goes to a log, printed if
# it fails. It starts after the main set-up, which it would otherwise slow down (the same
# network, and the extension's compilation). SKIP_XLA=1 skips it and its suite.
xla_setup=""
xla_log=build/xla-setup.log
stop_xla_setup() {
  if [ -n "$xla_setup" ] && kill -0 "$xla_setup" 2>/dev/null; then
    kill -- "-$xla_setup" 2>/dev/null || true   # its own process group: pip included
  fi
}
if [ "${SKIP_XLA:-0}" != 1 ]; then
  mkdir -p build
  setsid bash scripts/setup_xla.sh > "$xla_log" 2>&1 &
  xla_setup=$!
  trap stop_xla_setup EXIT
  trap 'exit 130' INT TERM   # Ctrl-C or a CI's cancel: the EXIT trap stops the set-up too
fi

export PYTHONUNBUFFERED=1
# Types first: a wrong annotation fails the run before the slow suite starts.
.venv/bin/python -m mypy torchstrategy
# Bound every collective in the suite: a bug fails fast instead of hanging CI.
export TORCHSTRATEGY_TIMEOUT_SECONDS=${TORCHSTRATEGY_TIMEOUT_SECONDS:-120}
# Two workers (pytest-xdist): most tests wait on the processes they start. Each test file
# stays on one worker (--dist loadfile): module fixtures start their processes once.
# The slowest 15 tests are listed at the end. TEST_WORKERS=N changes the number of workers.
main_status=0
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile --durations=15 "$@" \
  || main_status=$?

# TPUStrategy's suite, in the xla environment on 4 XLA:CPU devices (after the main suite).
if [ -n "$xla_setup" ]; then
  xla_status=0
  wait "$xla_setup" || xla_status=$?
  xla_setup=""
  if [ "$xla_status" != 0 ]; then
    cat "$xla_log" >&2
    echo "scripts/setup_xla.sh failed (exit $xla_status); its output is above." >&2
    exit "$xla_status"
  fi
  xla_tests=0
  PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python -m pytest -q --durations=15 tests/xla \
    || xla_tests=$?
  [ "$main_status" != 0 ] || main_status=$xla_tests
fi
exit "$main_status"
