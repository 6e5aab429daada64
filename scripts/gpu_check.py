"""The GPU proof in one command (issue 37): builds the extension for the GPU, runs the CUDA
tests, then the GPU benchmarks, and writes a report (markdown and JSON).

    bash scripts/gpu_check.sh                 # everything; report in $OUT/gpu_report or
                                              # build/gpu_report
    bash scripts/gpu_check.sh --dry-run       # every part with its command, nothing run
    bash scripts/gpu_check.sh --no-cuda       # the path of a machine without CUDA
    bash scripts/gpu_check.sh --bundle        # here: put pytest and ninja in build/gpu_pylib
                                              # for a GPU machine whose python lacks them

Each part runs as its own process under its own time limit (killed with its process group
when it runs over), so one failure or hang never hides the others; the whole run keeps to
--budget seconds (480 by default, the 8 minutes of one H100 lease: a part gets at most what
is left). Without CUDA (torch.cuda.is_available() false in the target python, or
--no-cuda) the parts that need a GPU are reported as skipped, with the reason, and the
others run: the tests' CPU references (tests/gpu, each CUDA case skipped and counted) and
the benchmarks' code paths at tiny sizes on the CPU. The exit status is 0 when no part
failed or ran out of time.

Nothing is downloaded: the build uses the target python's own torch and setuptools
(--no-build-isolation, PIP_NO_INDEX=1 for every part), pytest is used only if it imports
(else from build/gpu_pylib, else the test parts are skipped, saying so), and the pytest
plugins of the suite (xdist, timeout) are never required.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import gpu_report  # noqa: E402  (scripts/ is not a package)
from gpu_report import FAILED, PASSED, SKIPPED, TIMEOUT, Part  # noqa: E402

DEFAULT_BUDGET_S = 480
PYLIB = os.path.join(ROOT, "build", "gpu_pylib")
# What --bundle copies from this python's site-packages: pytest and what it imports.
BUNDLED_MODULES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments",
                   "py.py")
# Files of tests/gpu the test parts leave out: they test this script (run here, on CPU).
SCRIPT_TESTS = "tests/gpu/test_gpu_check.py"
# The CUDA cases of the suite outside tests/gpu.
SUITE_CUDA_TESTS = ("tests/collectives/test_ops.py",)

# Printed by the probe (the target python, which may lack CUDA or even torch), as JSON.
PROBE = r"""
import json, os, shutil, subprocess, sys
info = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if info["cuda_available"]:
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
        info["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) \
                else str(version)
        except Exception as error:
            info["nccl"] = "unavailable: %s" % error
    from torch.utils.cpp_extension import CUDA_HOME
    info["cuda_home"] = CUDA_HOME
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if nvcc and os.path.exists(nvcc):
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        info["nvcc"] = out.strip().splitlines()[-1] if out.strip() else "?"
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None and CUDA_HOME:
        candidate = os.path.join(CUDA_HOME, "bin", "compute-sanitizer")
        sanitizer = candidate if os.path.exists(candidate) else None
    info["compute_sanitizer"] = sanitizer
    from torch.utils.cpp_extension import is_ninja_available
    info["ninja"] = is_ninja_available()
except Exception as error:
    info["torch_error"] = "%s: %s" % (type(error).__name__, error)
import importlib.util
for name in ("pytest", "xdist", "pytest_timeout", "lightning", "torchvision", "torch_xla",
             "setuptools", "safetensors"):
    try:
        info["has_" + name] = importlib.util.find_spec(name) is not None
    except Exception:
        info["has_" + name] = False
print(json.dumps(info))
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="report directory (default: $OUT/gpu_report when $OUT "
                        "is set, else build/gpu_report)")
    parser.add_argument("--python", default=sys.executable,
                        help="the python that builds, tests and benchmarks (default: this "
                        "one)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list every part with its command and limit; run nothing")
    parser.add_argument("--no-cuda", action="store_true",
                        help="take the path of a machine without CUDA (the children see "
                        "CUDA_VISIBLE_DEVICES='')")
    parser.add_argument("--only", default="", help="comma-separated parts to run (the "
                        "others are reported as skipped)")
    parser.add_argument("--skip", default="", help="comma-separated parts not to run")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole run (default {DEFAULT_BUDGET_S}); a part "
                        "gets at most what is left")
    parser.add_argument("--arch", default="9.0",
                        help="TORCH_CUDA_ARCH_LIST of the build (default 9.0: H100/H200)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compile jobs (MAX_JOBS)")
    parser.add_argument("--build-mode", choices=("inplace", "pip"), default="inplace",
                        help="inplace: setup.py build_ext --inplace (default); pip: pip "
                        "install --no-build-isolation --no-deps --no-index -e .")
    parser.add_argument("--bench-scale", choices=("full", "tiny"), default="full",
                        help="sizes of the GPU benchmarks (default full; bench-cpu, run "
                        "without CUDA, is always tiny)")
    parser.add_argument("--tests", default="",
                        help="comma-separated test paths of the tests part (default: "
                        "tests/gpu and the suite's other CUDA tests)")
    parser.add_argument("--cpu-bench-kinds", default="kernels,mirrored,sharded",
                        help="the benchmarks bench-cpu runs at tiny sizes without CUDA")
    parser.add_argument("--bundle", action="store_true",
                        help=f"copy pytest (and its dependencies) and ninja from this python "
                        f"into {os.path.relpath(PYLIB, ROOT)} for a GPU machine lacking them, "
                        "then exit")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    kinds = [k for k in args.cpu_bench_kinds.split(",") if k]
    if not kinds or set(kinds) - {"kernels", "mirrored", "sharded"}:
        parser.error(f"--cpu-bench-kinds: give some of kernels,mirrored,sharded, got "
                     f"{args.cpu_bench_kinds!r}")
    known = {part.name for part in plan(args, {}, "")}
    for option in ("only", "skip"):
        names = [n for n in getattr(args, option).split(",") if n]
        unknown = sorted(set(names) - known)
        if unknown:
            parser.error(f"--{option}: no part named {', '.join(unknown)}; the parts are "
                         f"{', '.join(sorted(known))}")
        setattr(args, option, names)
    return args


def report_directory(args: argparse.Namespace) -> str:
    if args.out:
        return os.path.abspath(args.out)
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "gpu_report")
    return os.path.join(ROOT, "build", "gpu_report")


def plan(args: argparse.Namespace, probe: dict, out: str) -> list[Part]:
    """Every part, in order, with its command (`probe` is the target python's facts; empty
    for --dry-run before probing: the commands do not depend on them)."""
    py = args.python
    tiny = args.bench_scale == "tiny"   # the GPU benchmarks run only with CUDA: full sizes

    def at(name: str) -> str:
        return os.path.join(out, name) if out else f"<report>/{name}"

    pytest = [py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs"]
    build = ([py, "setup.py", "build_ext", "--inplace"] if args.build_mode == "inplace" else
             [py, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
              "-e", "."])
    sanitizer = probe.get("compute_sanitizer") or "compute-sanitizer"
    bench = [py, "scripts/gpu_bench.py"]
    scale = ["--tiny"] if tiny else []
    return [
        Part("environment", "The target python's torch, CUDA, NCCL, nvcc and test tools.",
             [py, "-c", "<probe: versions, CUDA, NCCL, nvcc, compute-sanitizer, pytest>"],
             timeout_s=120),
        Part("build", f"Builds torchstrategy._C with its CUDA kernels against this torch "
             f"(TORCH_CUDA_ARCH_LIST={args.arch}, MAX_JOBS={args.jobs}).", build,
             timeout_s=300, needs_cuda=True),
        Part("extension", "The built extension registers the CUDA kernels of pack and "
             "unpack (torch.ops.torchstrategy, dispatch key CUDA).",
             [py, "-c", "import torch, torchstrategy._C; "
              "ok = [torch._C._dispatch_has_kernel_for_dispatch_key("
              "'torchstrategy::' + op, 'CUDA') for op in ('pack', 'unpack')]; "
              "print('CUDA kernels registered:', ok); assert all(ok)"],
             timeout_s=60, needs_cuda=True),
        Part("bench-kernels", "pack+unpack against device-to-device copy and torch's "
             "flatten+scale+split; compression kernels against copy.",
             bench + ["kernels", "--device", "cuda", "--json", at("bench-kernels.json")]
             + scale, timeout_s=90, needs_cuda=True),
        Part("tests", "tests/gpu (kernels, MirroredStrategy, compression, mixed precision, "
             "ShardedStrategy, Lightning, TPUStrategy on CUDA) and the suite's other CUDA "
             "cases; without CUDA only their CPU references run and the CUDA cases are "
             "skipped, each with its reason.",
             # One xdist worker where the target has xdist: a test that crashes the
             # process (a segfault in an op) is reported as that test's failure and the
             # others still run and reach tests.xml (the first H100 run lost them).
             pytest + (["-n", "1"] if probe.get("has_xdist") else [])
             + ["--junitxml", at("tests.xml")]
             + ([t for t in args.tests.split(",") if t] or
                ["tests/gpu", *SUITE_CUDA_TESTS, "--ignore", SCRIPT_TESTS]),
             timeout_s=270),
        Part("bench-mirrored", "ResNet-50- and GPT-2-small-shaped steps: MirroredStrategy "
             "against DDP and a plain loop (world 1), step time and peak memory.",
             bench + ["mirrored", "--device", "cuda", "--json", at("bench-mirrored.json")]
             + scale, timeout_s=150, needs_cuda=True),
        Part("bench-sharded", "GPT-2-small-shaped step: ShardedStrategy against a "
             "hand-written FSDP2 loop (world 1), step time and peak memory.",
             bench + ["sharded", "--device", "cuda", "--json", at("bench-sharded.json")]
             + scale, timeout_s=120, needs_cuda=True),
        Part("memcheck", "compute-sanitizer memcheck over the CUDA kernel tests "
             "(out-of-bounds and misaligned accesses in pack/unpack).",
             # Without the caching allocator every tensor is its own allocation, so an
             # access past a tensor's end is outside any allocation, which memcheck sees.
             ["env", "PYTORCH_NO_CUDA_MEMORY_CACHING=1", sanitizer, "--tool", "memcheck",
              "--error-exitcode", "1", "--target-processes", "all"] + pytest
             + ["--junitxml", at("memcheck.xml"), "tests/gpu/test_kernels.py", "-k", "cuda"],
             timeout_s=150, needs_cuda=True),
        Part("bench-cpu", "The benchmarks' code paths at tiny sizes on the CPU (no figure "
             "there is a GPU figure); run only without CUDA.",
             bench + ["all", "--kinds", args.cpu_bench_kinds, "--device", "cpu", "--tiny",
                      "--json", at("bench-cpu.json")],
             timeout_s=120),
    ]


def cuda_usable(args: argparse.Namespace, probe: dict) -> bool:
    return not args.no_cuda and bool(probe.get("cuda_available"))


def cuda_reason(args: argparse.Namespace, probe: dict) -> str:
    """Why the GPU parts run or are skipped, one line."""
    if args.no_cuda:
        return "skipped: --no-cuda was given (CUDA_VISIBLE_DEVICES='' for every part)"
    if "torch_error" in probe:
        return f"skipped: torch does not import in {args.python}: {probe['torch_error']}"
    if not probe:
        return "skipped: the probe of the target python failed (see the environment part)"
    if not probe.get("cuda_available"):
        built = probe.get("torch_cuda")
        return ("skipped: torch.cuda.is_available() is False in " + args.python + " (torch "
                + str(probe.get("torch")) + (f", built for CUDA {built}: no GPU or driver "
                                             "visible)" if built else ", a CPU-only build)"))
    return (f"available: {probe.get('device')} (capability {probe.get('capability')}), "
            f"torch {probe.get('torch')} for CUDA {probe.get('torch_cuda')}, NCCL "
            f"{probe.get('nccl')}")


def child_environment(args: argparse.Namespace, probe: dict) -> dict[str, str]:
    env = dict(os.environ)
    env["PIP_NO_INDEX"] = "1"                 # never download anything
    env["PYTHONUNBUFFERED"] = "1"
    env["TORCH_CUDA_ARCH_LIST"] = args.arch
    env["MAX_JOBS"] = str(args.jobs)
    env.setdefault("TORCHSTRATEGY_TIMEOUT_SECONDS", "120")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS
    paths = [ROOT]
    if os.path.isdir(PYLIB) and not probe.get("has_pytest", True):
        paths.append(PYLIB)
        env["PATH"] = os.path.join(PYLIB, "bin") + os.pathsep + env.get("PATH", "")
    elif os.path.isdir(os.path.join(PYLIB, "bin")) and probe.get("ninja") is False:
        env["PATH"] = os.path.join(PYLIB, "bin") + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    if args.no_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif probe.get("cuda_available"):
        # The tests' CPU cases ran in CI: on the GPU the time goes to the CUDA ones.
        env["TORCHSTRATEGY_GPU_CHECK_CUDA_ONLY"] = "1"
    return env


def skip_reason(part: Part, args: argparse.Namespace, probe: dict, pytest_ok: bool) -> str:
    """Why `part` does not run ("" when it runs)."""
    if args.only and part.name not in args.only:
        return "not selected (--only)"
    if part.name in args.skip:
        return "not selected (--skip)"
    if part.needs_cuda and not cuda_usable(args, probe):
        return "needs CUDA, " + cuda_reason(args, probe)
    if part.name == "bench-cpu" and cuda_usable(args, probe):
        return "CUDA is available: the GPU benchmarks run instead"
    if part.name in ("tests", "memcheck") and not pytest_ok:
        return (f"pytest does not import in {args.python} (run `bash scripts/gpu_check.sh "
                "--bundle` where it does and carry build/gpu_pylib)")
    if part.name == "memcheck" and not probe.get("compute_sanitizer"):
        return "compute-sanitizer is not installed (not on PATH nor in CUDA_HOME/bin)"
    return ""


def run_part(part: Part, env: dict[str, str], timeout_s: float, log_path: str) -> None:
    """Runs `part` in its own process group, output to `log_path`; kills the group after
    `timeout_s`; fills in status, duration, return code and tail."""
    part.timeout_s = timeout_s
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        try:
            process = subprocess.Popen(part.command, cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as error:
            part.status, part.reason = FAILED, f"could not start: {error}"
            return
        try:
            part.returncode = process.wait(timeout=timeout_s)
            part.status = PASSED if part.returncode == 0 else FAILED
            if part.returncode != 0:
                part.reason = f"exit status {part.returncode}"
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
            part.status, part.reason = TIMEOUT, f"ran over its limit of {timeout_s:.0f} s"
    part.duration_s = time.monotonic() - start
    with open(log_path, encoding="utf-8", errors="replace") as log:
        part.tail = gpu_report.tail_of(log.read())


def probe_target(args: argparse.Namespace, env: dict[str, str], part: Part,
                 log_path: str) -> dict:
    """Runs the probe as the "environment" part; returns its facts ({} if it failed)."""
    command, part.command = part.command, [args.python, "-c", PROBE]
    run_part(part, env, part.timeout_s, log_path)
    part.command = command
    try:
        return json.loads(part.tail.strip().splitlines()[-1])
    except (ValueError, IndexError):
        part.status = FAILED
        part.reason = part.reason or "the probe printed no JSON"
        return {}


def bundle() -> int:
    """Copies pytest's modules and ninja from this python into PYLIB."""
    import importlib.util
    os.makedirs(os.path.join(PYLIB, "bin"), exist_ok=True)
    copied = []
    for name in BUNDLED_MODULES:
        spec = importlib.util.find_spec(name.removesuffix(".py"))
        if spec is None or spec.origin is None:
            continue
        source = os.path.dirname(spec.origin) if spec.submodule_search_locations else \
            spec.origin
        target = os.path.join(PYLIB, os.path.basename(source))
        if os.path.isdir(source):
            shutil.copytree(source, target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
        copied.append(os.path.basename(source))
    ninja = shutil.which("ninja") or os.path.join(os.path.dirname(sys.executable), "ninja")
    if os.path.exists(ninja):
        shutil.copy2(ninja, os.path.join(PYLIB, "bin", "ninja"))
        copied.append("ninja")
    print(f"copied into {PYLIB}: {', '.join(copied)} (pytest "
          f"{__import__('pytest').__version__}, for python >= 3.11 without pytest)")
    return 0


def pack_logs(out: str) -> None:
    """Replaces out/logs/ by one out/logs.tar.gz: the device tool brings back at most 8
    files, and the report, its two test XMLs and three benchmark JSONs are 7 already."""
    logs = os.path.join(out, "logs")
    with tarfile.open(os.path.join(out, "logs.tar.gz"), "w:gz") as archive:
        archive.add(logs, arcname="logs")
    shutil.rmtree(logs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bundle:
        return bundle()
    out = report_directory(args)
    if args.dry_run:
        print(f"gpu_check: dry run; the report would go to {out}; budget {args.budget:.0f} s; "
              f"python {args.python}")
        for part in plan(args, {}, out):
            needs = "needs CUDA" if part.needs_cuda else "no CUDA needed"
            print(f"- {part.name} ({needs}, limit {part.timeout_s:.0f} s): {part.description}")
            print(f"    $ {shlex.join(part.command)}")
        print("Every part runs with PIP_NO_INDEX=1, TORCH_CUDA_ARCH_LIST=" + args.arch +
              ", MAX_JOBS=" + str(args.jobs) + ", TORCHSTRATEGY_TIMEOUT_SECONDS=120.")
        return 0
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    started = time.monotonic()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"), "host": socket.gethostname(),
        "command": " ".join(["scripts/gpu_check.sh", *(argv if argv is not None
                                                       else sys.argv[1:])]),
        "budget_s": args.budget}
    env = child_environment(args, {})
    parts = plan(args, {}, out)
    probe = probe_target(args, env, parts[0], os.path.join(out, "logs", "environment.log"))
    parts = [parts[0]] + plan(args, probe, out)[1:]
    env = child_environment(args, probe)
    meta.update({"python": f"{probe.get('python', '?')} ({args.python})",
                 "torch": probe.get("torch", "?"), "cuda_reason": cuda_reason(args, probe),
                 "device": probe.get("device", "no CUDA device") if cuda_usable(args, probe)
                 else "CPU only (no CUDA)", "probe": probe})
    pytest_ok = bool(probe.get("has_pytest")) or os.path.isdir(os.path.join(PYLIB, "pytest"))
    print(f"gpu_check: CUDA {meta['cuda_reason']}; report in {out}", flush=True)
    for part in parts[1:]:
        reason = skip_reason(part, args, probe, pytest_ok)
        left = args.budget - (time.monotonic() - started)
        if not reason and left < 10:
            reason = f"the budget of {args.budget:.0f} s is spent"
        if reason:
            part.status, part.reason = SKIPPED, reason
            print(f"gpu_check: {part.name}: skipped: {reason}", flush=True)
            continue
        print(f"gpu_check: {part.name} (limit {min(part.timeout_s, left):.0f} s) ...",
              flush=True)
        run_part(part, env, min(part.timeout_s, left),
                 os.path.join(out, "logs", f"{part.name}.log"))
        xml = next((c for c in part.command if c.endswith(".xml")), None)
        if xml:
            part.tests = gpu_report.pytest_counts(xml)
        results = next((c for c in part.command if c.endswith(".json")), None)
        if results and os.path.exists(results):
            with open(results, encoding="utf-8") as f:
                part.results = json.load(f)
        print(f"gpu_check: {part.name}: {part.status} in {part.duration_s:.1f} s"
              + (f" ({part.reason})" if part.reason else ""), flush=True)
    meta["wall_s"] = round(time.monotonic() - started, 1)
    md_path, json_path = gpu_report.write(out, meta, parts)
    pack_logs(out)
    summary = gpu_report.summary(parts)
    print(f"gpu_check: {'OK' if summary['ok'] else 'FAILURES'} in {meta['wall_s']} s; "
          f"report: {md_path} and {json_path}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
