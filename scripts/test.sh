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
# background while the main suite keeps the CPUs busy, and TPUStrategy's suite (4 XLA:CPU
# devices) runs there as soon as it is: beside the main suite, at a lower priority (nice),
# so that its minutes fill the moments the main suite's tests wait on their processes
# instead of adding to the run's length. Both write to logs, printed at the end. It starts
# after the main set-up, which it would otherwise slow down (the same network, and the
# extension's compilation). SKIP_XLA=1 skips it and its suite.
# Bound every collective in both suites: a bug fails fast instead of hanging CI.
export TORCHSTRATEGY_TIMEOUT_SECONDS=${TORCHSTRATEGY_TIMEOUT_SECONDS:-120}
xla_job=""
xla_setup_log=build/xla-setup.log
xla_tests_log=build/xla-tests.log
xla_status_file=build/xla-status
stop_xla_job() {
  if [ -n "$xla_job" ] && kill -0 "$xla_job" 2>/dev/null; then
    kill -- "-$xla_job" 2>/dev/null || true   # its own process group: pip, pytest included
  fi
}
if [ "${SKIP_XLA:-0}" != 1 ]; then
  mkdir -p build
  rm -f "$xla_status_file" "$xla_tests_log"
  # The job records "setup N" or "tests N": which part ended it, and how.
  setsid bash -c '
    bash scripts/setup_xla.sh > "$1" 2>&1 || { echo "setup $?" > "$3"; exit 0; }
    status=0
    PYTHONUNBUFFERED=1 PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 nice -n 10 \
      .venv-xla/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests/xla \
      > "$2" 2>&1 || status=$?
    echo "tests $status" > "$3"
  ' xla-job "$xla_setup_log" "$xla_tests_log" "$xla_status_file" &
  xla_job=$!
  trap stop_xla_job EXIT
  trap 'exit 130' INT TERM   # Ctrl-C or a CI's cancel: the EXIT trap stops the job too
fi

export PYTHONUNBUFFERED=1
# The type check (about 35 s of one core from a cold cache) runs beside the main suite, at a
# lower priority, instead of before it; its output is printed at the end and a type error
# fails the run.
mkdir -p build
mypy_log=build/mypy.log
nice -n 5 .venv/bin/python -m mypy torchstrategy > "$mypy_log" 2>&1 &
mypy_job=$!
# Three workers (pytest-xdist) on 2 cores: most tests wait on the processes they start (a
# rendezvous, a timeout, a SLURM job's state), so a third file running meanwhile uses the
# cores they leave idle (measured on a fresh 2-core machine: the main suite 18:17 with two
# workers, 16:12 with three, every test passing both times). Each test file stays on one
# worker (--dist loadfile): module fixtures start their processes once. The longest files
# start first (tests/file_order.py: the last run's durations, else
# tests/file_durations.json), an order --no-loadscope-reorder keeps (xdist's own puts the
# files with most tests first, and a long one-test file could then end the run alone).
# The slowest 15 tests are listed at the end. TEST_WORKERS=N changes the number of workers.
main_status=0
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
  --durations=15 "$@" || main_status=$?

mypy_status=0
wait "$mypy_job" || mypy_status=$?
echo "--- mypy torchstrategy (run beside the main suite) ---"
cat "$mypy_log"
[ "$main_status" != 0 ] || main_status=$mypy_status

# TPUStrategy's suite, in the xla environment on 4 XLA:CPU devices: waited for, then shown.
if [ -n "$xla_job" ]; then
  wait "$xla_job" || true
  xla_job=""
  read -r xla_part xla_status < "$xla_status_file" || { xla_part=setup; xla_status=1; }
  if [ "$xla_part" = setup ]; then
    cat "$xla_setup_log" >&2
    echo "scripts/setup_xla.sh failed (exit $xla_status); its output is above." >&2
    exit "$xla_status"
  fi
  echo "--- TPUStrategy's suite (tests/xla, in .venv-xla, run beside the main suite) ---"
  cat "$xla_tests_log"
  [ "$main_status" != 0 ] || main_status=$xla_status
fi
exit "$main_status"
