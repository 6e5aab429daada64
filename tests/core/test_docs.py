"""The user guide cannot rot: its code runs, its links resolve, its API table is complete.

Convention (every docs/ page follows it):
- The fenced blocks of a page that start with ```python are concatenated, in order, and run
  as ONE script, as ``python page.py`` runs it: in a new process of this test's interpreter,
  in a fresh temporary working directory, with TORCHSTRATEGY_TIMEOUT_SECONDS set, under a
  120 s timeout. The script must exit 0. Blocks fenced ```python no-run are shown, not run.
- A page whose first line is ``<!-- docs-test: xla -->`` needs torch_xla: the core suite
  skips it (the xla suite runs it).
- Every relative link in docs/*.md and README.md must point at an existing file.
- Every name in ``torchstrategy.__all__`` must appear as ``ts.<name>`` in a row of the table
  in docs/coming_from_tf_distribute.md.

How (for speed, issue 36): the pages' processes are forked from one interpreter that has
imported torch, torchstrategy and the heavy libraries once (tests/helpers/warm_python.py says
what is the same as a fresh ``python page.py`` and what is not), instead of each page paying
those imports (several seconds each). The replicas a page starts are started by torchstrategy
as for any program. Every process runs one intra-op thread (OMP_NUM_THREADS=1): the suite
runs two test files at once on two cores, and a page's results do not depend on it.
"""
import glob
import os
import re

import pytest

import torchstrategy as ts

from tests.helpers import ROOT
from tests.helpers.warm_python import WarmPython
DOCS = os.path.join(ROOT, "docs")
PAGE_TIMEOUT_SECONDS = 120
XLA_MARKER = "<!-- docs-test: xla -->"
TABLE_PAGE = os.path.join(DOCS, "coming_from_tf_distribute.md")

_FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def pages():
    return sorted(glob.glob(os.path.join(DOCS, "*.md")))


def runnable_code(text):
    """The page's ```python blocks (not ```python no-run), concatenated in order."""
    blocks = [m["body"] for m in _FENCE.finditer(text) if m["info"].strip() == "python"]
    return "\n".join(blocks)


def _page_id(path):
    return os.path.basename(path)


def _env():
    env = dict(os.environ)
    env.setdefault("TORCHSTRATEGY_TIMEOUT_SECONDS", "60")
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    # A launcher's variables (pytest under torchrun) must not leak into the pages.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHSTRATEGY_LAUNCHER",
                 "TORCHSTRATEGY_PARENT_PID"):
        env.pop(name, None)
    return env


def test_convention_extracts_blocks_in_order_and_skips_no_run():
    text = ("intro\n```python\na = 1\n```\n```python no-run\nraise SystemExit(1)\n```\n"
            "```bash\nexit 1\n```\n```python\nassert a == 1\n```\n")
    assert runnable_code(text) == "a = 1\n\nassert a == 1\n"


@pytest.fixture(scope="module")
def warm_python():
    interpreter = WarmPython(_env())
    interpreter.start()   # its imports: once for all pages, in no page's time
    yield interpreter
    interpreter.close()


def test_pages_run_as_python_runs_a_script(warm_python, tmp_path):
    """The forked page process behaves as ``python page.py``: a failing page fails, and
    nothing one page does reaches the next."""
    first = tmp_path / "first"
    first.mkdir()
    (first / "first_page.py").write_text(
        "import os, sys, atexit\n"
        "assert __name__ == '__main__' and sys.argv == [__file__]\n"
        "assert os.getcwd() == os.path.dirname(__file__) == sys.path[0]\n"
        "assert sys.orig_argv[1:] == [__file__]\n"
        "os.environ['LEFT_BY_FIRST'] = '1'\n"
        "atexit.register(print, 'atexit ran')\n"
        "print('first ran')\n"
        "raise SystemExit(3)\n")
    code, stdout, _ = warm_python.run(first / "first_page.py", first, 30)
    assert (code, stdout) == (3, "first ran\natexit ran\n")
    second = tmp_path / "second"
    second.mkdir()
    (second / "second_page.py").write_text(
        "import os\n"
        "assert 'LEFT_BY_FIRST' not in os.environ\n"
        "torch.ones(1)   # not imported by this page: fails, preloaded or not\n")
    code, _, stderr = warm_python.run(second / "second_page.py", second, 30)
    assert code == 1 and "NameError: name 'torch' is not defined" in stderr, stderr


@pytest.mark.timeout(PAGE_TIMEOUT_SECONDS + 90)
@pytest.mark.parametrize("page", pages(), ids=_page_id)
def test_page_code_runs(page, tmp_path, warm_python):
    with open(page, encoding="utf-8") as f:
        text = f.read()
    if text.splitlines()[:1] == [XLA_MARKER]:
        pytest.skip("needs torch_xla: run by the xla suite")
    code = runnable_code(text)
    if not code.strip():
        pytest.skip("no runnable python blocks")
    script = tmp_path / (os.path.splitext(os.path.basename(page))[0] + "_page.py")
    script.write_text(code, encoding="utf-8")
    returncode, stdout, stderr = warm_python.run(script, tmp_path, PAGE_TIMEOUT_SECONDS)
    print(f"docs/{os.path.basename(page)}: {warm_python.last_cpu_seconds} CPU seconds")
    ended = (f"ran over {PAGE_TIMEOUT_SECONDS} s and was killed" if returncode is None
             else f"exited with {returncode}")
    assert returncode == 0, (
        f"the python blocks of docs/{os.path.basename(page)} {ended}\n"
        f"--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-4000:]}")


def _relative_links(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    text = _FENCE.sub("", text)  # code blocks may contain brackets and parentheses
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # http:, https:, mailto: ... and anchors within the page
        yield target


@pytest.mark.parametrize("path", pages() + [os.path.join(ROOT, "README.md")], ids=_page_id)
def test_relative_links_resolve(path):
    broken = []
    for target in _relative_links(path):
        file_part = target.split("#", 1)[0]
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
        if not os.path.exists(resolved):
            broken.append(target)
    assert not broken, f"{os.path.relpath(path, ROOT)} links to missing files: {broken}"


def test_every_public_name_is_in_the_tf_distribute_table():
    with open(TABLE_PAGE, encoding="utf-8") as f:
        rows = [line for line in f if line.lstrip().startswith("|")]
    table = "\n".join(rows)
    missing = [name for name in ts.__all__
               if not re.search(r"`ts\." + re.escape(name) + r"\b", table)]
    assert not missing, (f"add a row for each of {missing} to the table in "
                         "docs/coming_from_tf_distribute.md")


def test_index_links_every_page():
    with open(os.path.join(DOCS, "index.md"), encoding="utf-8") as f:
        linked = {os.path.normpath(os.path.join(DOCS, t.split("#")[0]))
                  for t in _relative_links(os.path.join(DOCS, "index.md"))}
    unlinked = [os.path.basename(p) for p in pages()
                if os.path.basename(p) != "index.md" and p not in linked]
    assert not unlinked, f"docs/index.md does not link {unlinked}"
