"""Launches many short 2-replica training jobs and counts how they end.

    python scripts/stress_exit.py [--jobs 100] [--only KIND] [--timeout 120] [--budget 3600]

Each job trains a small model for a few steps on 2 CPU replicas (gloo) and exits. The jobs
cycle through every combination of

- launch kind: re-execution (``python job.py``), torchrun
  (``python -m torch.distributed.run --nproc-per-node=2``) and ``ts.launch``;
- strategy: MirroredStrategy, MultiWorkerMirroredStrategy, ShardedStrategy (FSDP2);
- with or without a PreemptionCheckpointHandler around the loop.

For every job the script records the launcher's exit code, whether a replica printed
"terminate called" (std::terminate: the abort at exit this script was written to find),
how many replicas still had gloo's threads (a process group) after the runtime's
shutdown, that is at the interpreter's teardown ("alive"; ts.launch's replicas end with
os._exit after ts.launch released their group and are not counted), the processes of the
job still alive after it ended, what it left in its /tmp (a TMPDIR of its own: pymp-*
directories, anything but its output and checkpoint) and the /dev/shm entries
that appeared while it ran and that no process uses any more. torch's own leftovers,
torchrun's log directory (torchelastic_*) and the compile cache (torchinductor_<user>),
are counted apart ("torch"), not as failures. Every job has a directory
of its own (TMPDIR points into it), a timeout (``--timeout``), and the whole run stops
after ``--budget`` seconds. A table summarises the counts at the end; the exit status is 0
only if every job exited 0 with nothing left behind.

The job's own program is this file, run with ``--job``.
"""
from __future__ import annotations

import argparse
import collections
import glob
import itertools
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHES = ("reexec", "torchrun", "ts.launch")
STRATEGIES = ("mirrored", "multi_worker", "sharded")
STEPS = 4


# -- the job ------------------------------------------------------------------------------
# torch and torchstrategy are imported by the job's functions only: the driver, which runs
# for the whole stress run, stays a small process that imports neither.
def _make_strategy(kind: str, launch: str) -> Any:
    import torchstrategy as ts
    devices = ["cpu:0", "cpu:1"] if launch == "reexec" else None
    if kind == "mirrored":
        return ts.MirroredStrategy(devices=devices)
    if kind == "multi_worker":
        return ts.MultiWorkerMirroredStrategy(devices=devices)
    return ts.ShardedStrategy(devices=devices)


def _train(kind: str, launch: str, handler_dir: str | None) -> int:
    """A few training steps of a small model; returns the replica id."""
    import torch
    from torch import nn
    import torchstrategy as ts

    strategy = _make_strategy(kind, launch)
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    global_batch = 8
    x = torch.randn(global_batch * STEPS, 8)
    y = x.sum(1, keepdim=True)
    dataset = torch.utils.data.TensorDataset(x, y)
    loader = torch.utils.data.DataLoader(dataset, batch_size=global_batch)
    dist_data = strategy.experimental_distribute_dataset(loader)

    def replica_step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        per_example = ((model(xb) - yb) ** 2).squeeze(1)
        loss = ts.compute_average_loss(per_example, global_batch_size=global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def train_step(batch: tuple[torch.Tensor, ...]) -> None:
        loss = strategy.run(replica_step, args=batch)
        strategy.reduce(ts.ReduceOp.SUM, loss, axis=None)

    if handler_dir is None:
        for batch in dist_data:
            train_step(batch)
    else:
        handler = ts.PreemptionCheckpointHandler(
            strategy.cluster_resolver, {"model": model, "optimizer": optimizer}, handler_dir)
        with handler.watch_preemption_scope():
            for batch in dist_data:
                handler.run(train_step, batch)
    return strategy.extended.replica_id


def _launched_job(kind: str, handler_dir: str | None) -> int:
    # A ts.launch replica is a multiprocessing child, which ends with os._exit once
    # ts.launch released its group: no interpreter teardown, and no report (only the
    # launching process, which joins no group, reports).
    return _train(kind, "ts.launch", handler_dir)


JOB_OWN_FILES = ("output.txt", "ckpt")
TORCH_OWN_PREFIXES = ("torchelastic_", "torchinductor_")
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")
ALIVE_MARK = "stress_exit: gloo threads alive after shutdown:"


def _report_gloo_threads() -> None:
    """Prints how many of gloo's threads (a process group's) are still alive. Registered
    with atexit before any strategy exists, so it runs after the runtime's shutdown: a
    group destroyed there has no thread left, one that outlived it meets the interpreter's
    teardown."""
    alive = 0
    for task in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(task) as f:
                alive += f.read().strip() in GLOO_THREADS
        except OSError:
            continue
    print(f"{ALIVE_MARK} {alive}", file=sys.stderr, flush=True)


def run_job(launch: str, kind: str, handler: bool, out: str) -> None:
    """The job's program (``--job``): trains, then ends normally."""
    import atexit
    atexit.register(_report_gloo_threads)
    handler_dir = os.path.join(out, "ckpt") if handler else None
    if launch == "ts.launch":
        import torchstrategy as ts
        ts.launch(_launched_job, kind, handler_dir, num_replicas=2)
    else:
        _train(kind, launch, handler_dir)


# -- the driver ---------------------------------------------------------------------------
def _children_of(pid: int) -> list[int]:
    """Every live descendant of `pid` (read from /proc)."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents[int(fields[1])].append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _processes_with(marker: str) -> list[int]:
    """Processes whose command line or environment names `marker` (the job's directory)."""
    pids = []
    for entry in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(entry, "cmdline"), "rb") as f:
                cmdline = f.read()
            with open(os.path.join(entry, "environ"), "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline or marker.encode() in environ:
            pids.append(int(entry.rsplit("/", 1)[1]))
    return [p for p in pids if p != os.getpid()]


def _snapshot() -> set[str]:
    # The job's /tmp/pymp-* land in its own TMPDIR (counted below); /tmp itself is shared
    # with whatever else runs on the machine.
    return set(glob.glob("/dev/shm/*"))


def _orphans(paths: list[str]) -> list[str]:
    """The entries of `paths` that still exist and that no live process has open or mapped
    (a named semaphore of another program on the machine is not the job's leftover)."""
    paths = [p for p in paths if os.path.exists(p)]
    if not paths:
        return []
    used: set[str] = set()
    for entry in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(entry, "maps")) as f:
                used.update(line.split(None, 5)[-1].strip() for line in f
                            if "/dev/shm/" in line)
            for fd in os.listdir(os.path.join(entry, "fd")):
                try:
                    used.add(os.readlink(os.path.join(entry, "fd", fd)))
                except OSError:
                    continue
        except OSError:
            continue
    return [p for p in paths if p not in used]


def _allow_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE,
                       (resource.RLIM_INFINITY, resource.getrlimit(resource.RLIMIT_CORE)[1]))


def launch_job(launch: str, kind: str, handler: bool, job_dir: str,
               timeout: float, cores: bool = False) -> dict[str, object]:
    """Runs one job; returns what happened (exit code, abort seen, leftovers)."""
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    env["TMPDIR"] = job_dir            # multiprocessing's pymp-* and the job's files
    env["TORCHSTRATEGY_STRESS_JOB"] = job_dir   # finds the job's processes afterwards
    env["TORCHSTRATEGY_TIMEOUT_SECONDS"] = str(int(timeout))
    env["PYTHONFAULTHANDLER"] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    job = [os.path.abspath(__file__), "--job", launch, kind, "1" if handler else "0", job_dir]
    if launch == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.1", *job]
    else:
        command = [sys.executable, *job]
    before = _snapshot()
    start = time.monotonic()
    with open(os.path.join(job_dir, "output.txt"), "w") as output:
        process = subprocess.Popen(command, env=env, cwd=job_dir, stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=_allow_core_dumps if cores else None)
        code: int | str
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = "timeout"
    seconds = time.monotonic() - start
    # A process still exiting (ts.launch's fork server ends once its parent closed the
    # socket) is not yet a leftover: give them a few seconds.
    settle = time.monotonic() + 5.0
    leftovers = _processes_with(job_dir)
    while leftovers and time.monotonic() < settle:
        time.sleep(0.2)
        leftovers = _processes_with(job_dir)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    files = _orphans(sorted(_snapshot() - before))
    if files:
        # another program's short-lived semaphores (created and unlinked by their owner)
        # are gone a moment later; a leftover stays
        time.sleep(2.0)
        files = _orphans(files)
    # What the job left in its own TMPDIR (its /tmp) counts too, pymp-* first of all,
    # except its output, its checkpoint and core dumps; torchrun's agent's log directory
    # (torchelastic_*: torchrun never removes it, whatever the replicas do) and torch's
    # per-user compile cache (torchinductor_<user>: one per user, kept on purpose) are
    # torch's own, counted apart.
    for name in sorted(os.listdir(job_dir)):
        if name in JOB_OWN_FILES or name.startswith("core"):
            continue
        if not name.startswith(TORCH_OWN_PREFIXES):
            files.append(os.path.join(job_dir, name))
    torch_own = sorted(name for name in os.listdir(job_dir)
                       if name.startswith(TORCH_OWN_PREFIXES))
    with open(os.path.join(job_dir, "output.txt"), errors="replace") as f:
        text = f.read()
    # replicas (one line each) whose process group outlived the runtime's shutdown
    # (two replicas' lines can interleave on the shared output: search, do not split)
    reports = [int(count) for count in re.findall(re.escape(ALIVE_MARK) + r" (\d+)", text)]
    return {"code": code, "terminate": "terminate called" in text,
            "group_alive": sum(count > 0 for count in reports), "reports": len(reports),
            "processes": leftovers,
            "files": files, "torch_own": torch_own, "seconds": seconds, "output": text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--only", choices=LAUNCHES, help="one launch kind only")
    parser.add_argument("--strategy", choices=STRATEGIES, help="one strategy only")
    parser.add_argument("--handler", choices=("yes", "no"), help="with/without the handler")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per job")
    parser.add_argument("--budget", type=float, default=3600.0, help="seconds in all")
    parser.add_argument("--cores", action="store_true",
                        help="allow core dumps (written to the job's directory with "
                             "core_pattern 'core'; use with --keep and gdb)")
    parser.add_argument("--keep", action="store_true", help="keep the failing jobs' dirs")
    args = parser.parse_args(argv)
    combos = [(launch, kind, handler)
              for launch in ([args.only] if args.only else LAUNCHES)
              for kind in ([args.strategy] if args.strategy else STRATEGIES)
              for handler in ({"yes": [True], "no": [False]}.get(args.handler or "",
                                                                  [False, True]))]
    root = tempfile.mkdtemp(prefix="stress_exit_")
    results: dict[tuple[str, str, bool], list[dict[str, object]]] = \
        collections.defaultdict(list)
    deadline = time.monotonic() + args.budget
    ran = 0
    for number, combo in zip(range(args.jobs), itertools.cycle(combos)):
        if time.monotonic() > deadline:
            print(f"budget of {args.budget:.0f} s spent after {ran} jobs", flush=True)
            break
        job_dir = os.path.join(root, f"job{number:04d}")
        os.makedirs(job_dir)
        result = launch_job(*combo, job_dir, args.timeout, args.cores)
        results[combo].append(result)
        ran += 1
        bad = result["code"] != 0 or result["terminate"] or result["group_alive"] or \
            result["processes"] or result["files"]
        print(f"{number:4d} {combo[0]:9s} {combo[1]:12s} handler={int(combo[2])} "
              f"exit={result['code']} {result['seconds']:.1f}s"
              + (" TERMINATE" if result["terminate"] else "")
            + (f" group-alive={result['group_alive']}" if result["group_alive"] else "")
              + (f" processes={result['processes']}" if result["processes"] else "")
              + (f" files={result['files']}" if result["files"] else ""), flush=True)
        if bad and args.keep:
            print(f"     kept: {job_dir}", flush=True)
        else:
            subprocess.run(["rm", "-rf", job_dir], check=False)
    print()
    header = f"{'launch':9s} {'strategy':12s} {'handler':7s} {'jobs':>4s} {'exit 0':>6s} " \
             f"{'other exits':16s} {'terminate':>9s} {'alive':>5s} {'procs':>5s} {'files':>5s}" \
             f" {'torch':>5s}"
    print(header)
    print("-" * len(header))
    failures = 0
    for combo in combos:
        runs = results.get(combo, [])
        if not runs:
            continue
        codes = collections.Counter(r["code"] for r in runs)
        others = ", ".join(f"{c}:{n}" for c, n in sorted(codes.items(), key=str) if c != 0)
        terminates = sum(bool(r["terminate"]) for r in runs)
        procs = sum(bool(r["processes"]) for r in runs)
        alive = sum(bool(r["group_alive"]) for r in runs)
        files = sum(bool(r["files"]) for r in runs)
        torch_own = sum(bool(r["torch_own"]) for r in runs)
        failures += sum(r["code"] != 0 or bool(r["terminate"]) or bool(r["group_alive"])
                        or bool(r["processes"]) or bool(r["files"]) for r in runs)
        print(f"{combo[0]:9s} {combo[1]:12s} {str(combo[2]):7s} {len(runs):4d} "
              f"{codes.get(0, 0):6d} {others:16s} {terminates:9d} {alive:5d} {procs:5d} {files:5d}"
              f" {torch_own:5d}")
    seconds = [float(str(r["seconds"])) for runs in results.values() for r in runs]
    if len(seconds) >= 2:
        low, median, high = statistics.quantiles(seconds, n=4)
        print(f"\nseconds per job: median {median:.1f} (quartiles {low:.1f} - {high:.1f}, "
              f"longest {max(seconds):.1f})")
    print(f"\n{ran} jobs, {failures} not clean")
    if not args.keep:
        subprocess.run(["rm", "-rf", root], check=False)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--job":
        launch_arg, kind_arg, handler_arg, out_arg = sys.argv[2:6]
        run_job(launch_arg, kind_arg, handler_arg == "1", out_arg)
    else:
        sys.exit(main())
