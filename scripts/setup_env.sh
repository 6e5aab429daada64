#!/usr/bin/env bash
# The package environment, idempotent: a .venv with torch 2.13.0 (the CPU wheel on machines
# without a GPU), what the library and the quickstart need (numpy, tqdm, scikit-learn), and
# torchstrategy built in place with its C++ extension. Installs nothing outside the clone
# and its .venv (pip's cache aside). scripts/demo.sh runs only this; scripts/setup.sh runs it
# and then the test set-up (scripts/setup_tests.sh) and the xla environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.torchstrategy-env

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# torch pinned in the same resolution as the rest (one pip run: one start-up and one
# resolution instead of two): nothing that depends on torch can then pull another build
# (the multi-GB CUDA one). The build tools come with it: the extension's build uses the
# installed torch (--no-build-isolation).
want_torch="torch==2.13.0 setuptools wheel ninja"
want_deps="numpy tqdm scikit-learn"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want_torch $want_deps" ]; then
  "$PY" -m pip install -q $want_torch $want_deps
  echo "$want_torch $want_deps" > "$STAMP"
fi

# Rebuild the extension only when a C++/CUDA source or the build script changed. Without
# debug information (-g0 after Python's -g): the same code, built in about two thirds of
# the time (CFLAGS=... overrides it). The units compile on every core (MAX_JOBS=...
# overrides it).
build_stamp=$VENV/.torchstrategy-build
sources_hash=$(cat setup.py setup.cfg pyproject.toml csrc/* 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ ! -f "$build_stamp" ] || [ "$(cat "$build_stamp")" != "$sources_hash" ] \
   || ! "$PY" -c "import torchstrategy._C" 2>/dev/null; then
  CFLAGS=${CFLAGS:--g0} MAX_JOBS=${MAX_JOBS:-$(nproc 2>/dev/null || echo 2)} \
    "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  echo "$sources_hash" > "$build_stamp"
fi

# The package's bytecode, written now: where the environment forbids writing it at import
# (PYTHONDONTWRITEBYTECODE=1, as in many CI and container images), every process would
# otherwise compile the package's ~120 modules from source (0.5 s of CPU per replica on a
# 2-core machine). Python reads existing bytecode whatever that setting; a changed source
# is compiled again at import, so stale bytecode is never used.
"$PY" -m compileall -q -j 0 torchstrategy examples scripts >/dev/null
