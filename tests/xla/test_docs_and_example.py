"""The xla pages of docs/ (first line ``<!-- docs-test: xla -->``) and examples/tpu.py, run
as a user runs them, in fresh processes on 4 XLA:CPU devices."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
XLA_MARK = "<!-- docs-test: xla -->"
ENV = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
           PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def xla_pages():
    return sorted(p for p in (ROOT / "docs").glob("*.md")
                  if p.read_text().splitlines()[:1] == [XLA_MARK])


def python_blocks(text):
    """The ```python blocks of a page in order (```python no-run blocks excluded)."""
    return re.findall(r"^```python[ \t]*\n(.*?)^```", text, flags=re.M | re.S)


def test_the_tpu_page_is_an_xla_page():
    assert ROOT / "docs" / "tpu.md" in xla_pages()


@pytest.mark.parametrize("page", xla_pages(), ids=lambda p: p.name)
def test_docs_page_runs(page, tmp_path):
    script = tmp_path / "page.py"
    script.write_text("\n".join(python_blocks(page.read_text())))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]


def test_example_trains_resnet18(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "tpu.py"), "--steps", "4"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "4 replicas, global batch 32, 4 steps" in run.stdout
