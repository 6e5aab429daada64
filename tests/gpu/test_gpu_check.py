"""scripts/gpu_check.sh where there is no GPU: its arguments, --dry-run's listing of every
part, the report writer (markdown and JSON), and the path of a machine without CUDA (exit 0,
the GPU parts reported skipped with the reason, the CPU parts run: a test part counted
from its JUnit XML, the kernel benchmark at tiny sizes on the CPU)."""
import importlib.util
import json
import os
import subprocess
import sys
import tarfile

import pytest

from tests.helpers import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
GPU_PARTS = ["build", "extension", "memcheck", "bench-kernels", "bench-mirrored",
             "bench-sharded"]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


gpu_report = _load("gpu_report")


def _run(*args, env=None, timeout=120):
    environment = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    environment.pop("OUT", None)
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_lists_every_part_with_its_command():
    done = _run("--dry-run", "--out", "/tmp/nowhere")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for part in ["environment", "build", "extension", "tests", "memcheck", "bench-kernels",
                 "bench-mirrored", "bench-sharded", "bench-cpu"]:
        assert f"- {part} (" in out, part
    assert "setup.py build_ext --inplace" in out
    assert "TORCH_CUDA_ARCH_LIST=9.0" in out and "PIP_NO_INDEX=1" in out
    assert "compute-sanitizer --tool memcheck" in out
    assert "-m pytest -p no:cacheprovider" in out and " -n " not in out   # no xdist needed
    assert "--timeout" not in out                                        # nor pytest-timeout
    assert "tests/gpu tests/collectives/test_ops.py --ignore tests/gpu/test_gpu_check.py" in out
    for kind in ("kernels", "mirrored", "sharded"):
        assert f"scripts/gpu_bench.py {kind} --device cuda --json /tmp/nowhere/bench-{kind}.json" \
            in out
    assert not os.path.exists("/tmp/nowhere")                            # nothing written
    pip = _run("--dry-run", "--build-mode", "pip", "--arch", "8.0;9.0", "--jobs", "3").stdout
    assert "pip install --no-build-isolation --no-deps --no-index -e ." in pip
    assert "TORCH_CUDA_ARCH_LIST=8.0;9.0, MAX_JOBS=3" in pip


@pytest.mark.parametrize("args,message", [
    (["--only", "tests,nonsense"], "--only: no part named nonsense; the parts are bench-cpu"),
    (["--skip", "buld"], "--skip: no part named buld"),
    (["--budget", "0"], "--budget must be a positive number of seconds"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--cpu-bench-kinds", "kernels,gpu"], "--cpu-bench-kinds: give some of"),
    (["--build-mode", "conda"], "invalid choice: 'conda'"),
])
def test_bad_arguments_are_refused_by_name(args, message):
    done = _run(*args, "--dry-run")
    assert done.returncode == 2 and message in done.stderr, done.stderr


def _parts():
    Part = gpu_report.Part
    return [
        Part("environment", "versions", ["python3", "-c", "probe"], 120, status="passed",
             duration_s=1.5, returncode=0, tail="{}"),
        Part("build", "builds", ["python3", "setup.py"], 300, needs_cuda=True,
             status="skipped", reason="needs CUDA, skipped: --no-cuda was given"),
        Part("tests", "the tests", ["python3", "-m", "pytest"], 270, status="failed",
             duration_s=42.0, returncode=1, reason="exit status 1",
             tail="line 1\nE   assert loss == expected\n1 failed",
             tests={"passed": 5, "failed": 1, "skipped": 2, "errors": 0,
                    "skip_reasons": {"needs a CUDA GPU": 2}, "failures": ["t::test_x"]}),
        Part("bench-kernels", "kernels", ["python3", "scripts/gpu_bench.py"], 90,
             status="timeout", duration_s=90.0, reason="ran over its limit of 90 s"),
        Part("bench-mirrored", "mirrored", ["python3", "scripts/gpu_bench.py"], 150,
             status="passed", duration_s=80.0, returncode=0,
             results={"figures": [
                 {"name": "gpt2: step time ours / DDP (world 1)", "value": 1.011, "unit": "x",
                  "spread": "quartiles 1.002 .. 1.020", "target": "<= 1.02", "met": True},
                 {"name": "gpt2: peak memory ours / DDP", "value": 1.25, "unit": "x",
                  "spread": "", "target": "<= 1", "met": False},
                 {"name": "copy | bandwidth", "value": None, "unit": "", "spread": "",
                  "target": None, "met": None}]}),
    ]


def test_the_report_lists_every_part_figure_and_reason(tmp_path):
    meta = {"date": "2026-11-27 09:00:00 UTC", "device": "NVIDIA H100 80GB HBM3",
            "cuda_reason": "available: H100", "python": "3.12", "torch": "2.11.0+cu130"}
    md_path, json_path = gpu_report.write(str(tmp_path / "r"), meta, _parts())
    md = open(md_path).read()
    assert "- device: NVIDIA H100 80GB HBM3" in md and "- date: 2026-11-27" in md
    assert "| build | skipped | 0.0 | 300 | needs CUDA, skipped: --no-cuda was given |" in md
    assert "| tests | failed | 42.0 | 270 | 5 passed, 1 failed, 0 errors, 2 skipped; exit " \
           "status 1 |" in md
    assert "| bench-kernels | timeout | 90.0 | 90 | ran over its limit of 90 s |" in md
    assert "| bench-mirrored | gpt2: step time ours / DDP (world 1) | 1.011 x | quartiles " \
           "1.002 .. 1.020 | <= 1.02 | yes |" in md
    assert "| gpt2: peak memory ours / DDP | 1.250 x |  | <= 1 | **no** |" in md
    assert "copy \\| bandwidth | n/a" in md                      # a cell cannot break the table
    assert "Targets met: 1; missed: gpt2: peak memory ours / DDP." in md
    assert "- 2 x needs a CUDA GPU" in md
    assert "Failed: t::test_x" in md and "E   assert loss == expected" in md
    assert "result: FAILURES; parts passed 2, failed 1, timed out 1, skipped 1; tests passed " \
           "5, failed 1, errors 0, skipped 2" in md
    report = json.load(open(json_path))
    assert report["meta"]["torch"] == "2.11.0+cu130"
    assert [p["name"] for p in report["parts"]] == [p.name for p in _parts()]
    assert report["summary"] == {
        "parts": {"passed": ["environment", "bench-mirrored"], "failed": ["tests"],
                  "timeout": ["bench-kernels"], "skipped": ["build"]},
        "tests": {"passed": 5, "failed": 1, "skipped": 2, "errors": 0},
        "targets_met": ["gpt2: step time ours / DDP (world 1)"],
        "targets_missed": ["gpt2: peak memory ours / DDP"], "ok": False}
    assert report["parts"][2]["tail"].endswith("1 failed")


def test_tail_and_pytest_counts(tmp_path):
    assert gpu_report.tail_of("\n".join(str(i) for i in range(100)), 3) == "97\n98\n99"
    xml = tmp_path / "run.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="off"><skipped message="needs a CUDA GPU"/></testcase>'
        '<testcase classname="a" name="off2"><skipped message="needs a CUDA GPU"/></testcase>'
        '<testcase classname="a" name="bad"><failure message="boom"/></testcase>'
        '<testcase classname="b" name="broken"><error message="fixture"/></testcase>'
        '</testsuite></testsuites>')
    assert gpu_report.pytest_counts(str(xml)) == {
        "passed": 1, "failed": 1, "skipped": 2, "errors": 1,
        "skip_reasons": {"needs a CUDA GPU": 2}, "failures": ["a::bad", "b::broken"]}
    assert gpu_report.pytest_counts(str(tmp_path / "missing.xml")) is None
    (tmp_path / "cut.xml").write_text("<testsuites><testsuite>")  # the run died mid-write
    assert gpu_report.pytest_counts(str(tmp_path / "cut.xml")) is None


def test_without_cuda_the_gpu_parts_are_skipped_and_the_cpu_parts_run(tmp_path):
    out = tmp_path / "report"
    done = _run("--no-cuda", "--out", str(out), "--tests",
                "tests/gpu/test_kernels.py::test_the_cuda_kernels_are_registered",
                "--cpu-bench-kinds", "kernels", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.load(open(out / "report.json"))
    parts = {p["name"]: p for p in report["parts"]}
    assert report["summary"]["ok"] is True
    assert report["meta"]["device"] == "CPU only (no CUDA)"
    for name in GPU_PARTS:
        assert parts[name]["status"] == "skipped"
        assert parts[name]["reason"] == "needs CUDA, skipped: --no-cuda was given " \
                                        "(CUDA_VISIBLE_DEVICES='' for every part)"
    assert parts["environment"]["status"] == "passed"
    assert report["meta"]["probe"]["cuda_available"] is False
    tests = parts["tests"]
    assert tests["status"] == "passed", tests["tail"]
    assert (tests["tests"]["passed"], tests["tests"]["skipped"]) == (1, 1)
    assert list(tests["tests"]["skip_reasons"]) == [
        "needs a CUDA GPU (torch.cuda.is_available() is False here)"]
    bench = parts["bench-cpu"]
    assert bench["status"] == "passed", bench["tail"]
    names = [f["name"] for f in bench["results"]["figures"]]
    assert "kernels: pack+unpack bandwidth / copy bandwidth" in names
    assert all(f["met"] is None for f in bench["results"]["figures"])   # not GPU figures
    assert bench["results"]["device"].startswith("CPU")
    md = open(out / "report.md").read()
    assert "- CUDA: skipped: --no-cuda was given" in md
    assert "| memcheck | skipped |" in md and "| bench-cpu | passed |" in md
    # Every part's log in one archive (the device tool brings back 8 files at most).
    with tarfile.open(out / "logs.tar.gz") as archive:
        assert "logs/tests.log" in archive.getnames()
    assert not os.path.exists(out / "logs")
