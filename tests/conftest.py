import importlib.util

# tests/xla/ needs torch_xla and runs in its own environment (.venv-xla, see scripts/test.sh).
collect_ignore = [] if importlib.util.find_spec("torch_xla") else ["xla"]
