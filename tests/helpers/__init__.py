"""Helpers shared by the test areas. Nothing here is imported by torchstrategy itself.

Multi-process tests launch replicas that import test modules by their full name
(``tests.core.test_equivalence``), so the repository root must be importable: pytest puts it
on ``sys.path`` (``pythonpath`` in pyproject.toml) and subprocess helpers add it to
``PYTHONPATH`` (`ROOT`).
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
