"""torch_xla support for `TPUStrategy`, imported only when a TPUStrategy is made.

``import torchstrategy`` never imports torch_xla: this package's modules import it through
`require_torch_xla`, which names the install command when it is missing.
"""
from __future__ import annotations

import importlib
import types

import torch

INSTALL_COMMAND = "pip install torch==2.9.0 torch_xla==2.9.0"


def require_torch_xla() -> types.ModuleType:
    """Imports torch_xla and returns it.

    Raises:
      ImportError: torch_xla is not installed (or does not match the installed torch), with
        the command that installs it.
    """
    try:
        return importlib.import_module("torch_xla")
    except ImportError as error:
        raise ImportError(
            f"TPUStrategy needs torch_xla, which is not importable here (torch "
            f"{torch.__version__}): {error}. torch_xla needs exactly the torch it was built "
            f"for; install both in their own environment with `{INSTALL_COMMAND}` "
            "(`bash scripts/setup.sh` makes one at .venv-xla)."
        ) from error
