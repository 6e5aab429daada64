#!/usr/bin/env bash
# Idempotent set-up of the xla environment (TPUStrategy, tested on XLA:CPU): torch_xla needs
# exactly the torch it was built for, so it gets its own venv. torch 2.9.0 comes from PyPI as
# the CUDA build with its nvidia-* wheels (~7 GB, no CPU wheel is reachable here).
# torchstrategy is put on its path with a .pth file, without building: its extension is for
# torch 2.13 and TPUStrategy does not use it. scripts/setup.sh runs it (SKIP_XLA=1 skips it);
# scripts/test.sh runs it on its own, beside the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
XLA_VENV=.venv-xla
XLA_STAMP=$XLA_VENV/.torchstrategy-setup
xla_deps="torch==2.9.0 torch_xla==2.9.0 torchvision==0.24.0 pytest pytest-timeout"
if [ ! -x "$XLA_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$XLA_VENV"
fi
if [ ! -f "$XLA_STAMP" ] || [ "$(cat "$XLA_STAMP")" != "$xla_deps" ]; then
  "$XLA_VENV/bin/python" -m pip install -q $xla_deps
  echo "$xla_deps" > "$XLA_STAMP"
fi
"$XLA_VENV/bin/python" -c "import sysconfig; print('$PWD', file=open(sysconfig.get_paths()['purelib'] + '/torchstrategy-source.pth', 'w'))"
