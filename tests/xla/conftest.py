"""The TPUStrategy suite: 4 XLA:CPU devices in this process (torch_xla SPMD).

Run in the xla environment: ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python -m
pytest tests/xla`` (scripts/test.sh does it). The defaults below make a bare pytest run there
work too; they must be set before torch_xla starts its runtime.
"""
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import pytest  # noqa: E402

import torchstrategy as ts  # noqa: E402


@pytest.fixture(scope="session")
def strategy():
    """One TPUStrategy for the session (SPMD mode is process-wide anyway)."""
    return ts.TPUStrategy()
