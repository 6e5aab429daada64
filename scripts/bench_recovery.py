"""Live recovery (issue 34): its cost per step when nothing fails, and the seconds from a
lost replica to the next completed step, side by side with a restart of the job.

One run starts ``--replicas`` processes (gloo, CPU, loopback; each given a launcher's
variables, rank 0 serving the rendezvous store) that train an MLP whose training state
(parameters, gradients, SGD momentum) is about ``--state-mb`` MiB:

1. **Per-step cost.** In the same processes, ``--rounds`` x ``--block`` iterations each run
   one step of each kind, in an order that rotates: ``strategy.run(step, args=(share,))``,
   ``recovery.run(step, global_batch)`` (a commit every step), the same with
   ``commit_every=--commit-every`` and the same with ``vote_every=--vote-every`` (a
   vote every that many steps, the others applied with no store request); the median step time of each, its spread
   (interquartile range) and the overhead in percent are printed, twice: median over
   median, and paired (the median, and IQR, of each step's ratio to the ``strategy.run``
   step of the same iteration, which ran under the same load). With a commit
   every step the replicas vote in the optimizer's step pre-hook and copy only buffers,
   gradients present and random state; with ``commit_every=k`` they copy the whole state
   and vote every k steps. The vote's own time (`StepCommit.decide`: a store ``add``,
   then ``wait`` + ``get`` or ``compare_set``) is printed too, and the process's CPU time
   per step of each kind (every thread, paired the same way): the work live recovery adds,
   which other jobs on a shared machine do not blur as they blur the wall time (a wait,
   such as the vote's, costs no CPU). ``--cost-only`` stops here.
2. **Recovery.** Replica ``replicas - 1`` then SIGKILLs itself between forward and backward;
   the survivors recover and go on. Printed: the seconds from the kill (its time written to
   a file just before) to the next committed step on replica 0, and the recovery's own
   duration (``Recovery.seconds``: agreement and new group; the agreement waits until the
   lost replica's heartbeat is ``--detection`` seconds old), and the parts of the former:
   the kill until replica 0 noticed (its ``_regroup`` called), the recovery, then the
   step redone.
3. **A joiner.** Once the loss happened a fresh process joins (``join=``): printed, the
   seconds from its start to its first step as a replica (import, admission at the next
   commit, the state broadcast by replica 0), and its parts: the import, the strategy and
   model, the admission (``LiveRecovery(join=...)`` until it returns: the wait for the
   members' next commit, the new group, and the state from replica 0, itself split into
   the parameters and buffers (``broadcast_``) with the counters (``broadcast_object``),
   and the optimizer state (``broadcast_state``: its structure by ``broadcast_object``, its
   tensors by ``broadcast_``), with the totals of ``broadcast_`` and ``broadcast_object``;
   timed by wrapping those functions in the joiner) and the first step; and how long
   replica 0 paused for the admission (its ``_admit``).
4. **Restart, for comparison.** The path of today (issue 34): ``replicas - 1`` fresh
   processes start, import torch and torchstrategy, form their group, build the model,
   load the state from a local file (saved by replica 0 at the end of phase 2) and run one
   step. Printed: the seconds from their start to that step, and its parts, among them
   the local load alone (``torch.load`` of the file, then ``load_state_dict``), twice:
   from the cold file (its pages dropped from the page cache with ``posix_fadvise``, so
   read from the disk, as a checkpoint written long before or by another machine is),
   then from the warm file the first load left in the cache. This is a lower bound of a torchrun
   restart, whose rendezvous adds its heartbeat and last-call waits (docs: 18-37 s in all
   for a tiny model). Last, the ratio of the joiner's admission to that local load (issue
   34's target: at most 1.5), and the same without the wait for a commit.

Run it alone on the machine (``nice -n 10`` when shared), e.g.
``python scripts/bench_recovery.py --replicas 3 --state-mb 50``. Timings on a shared
2-core machine are noisy: compare the numbers of one run, and give the load with them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _width(state_mb: float) -> int:
    # Training state = parameters + gradients + momentum: 3 x 4 bytes per parameter, in two
    # square layers.
    return max(8, int((state_mb * 2 ** 20 / 12 / 2) ** 0.5))


def _model(state_mb: float) -> torch.nn.Sequential:
    width = _width(state_mb)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width))


def _timed(owner: object, name: str, into: dict[str, float]) -> None:
    """Wraps ``owner.name`` (a class's method or a module's function, in this process) to add each call's seconds to ``into[name]``
    and to note the wall time its first call started in ``into[name + "_first_at"]``."""
    method = getattr(owner, name)

    def timed(*args: object, **kwargs: object) -> object:
        into.setdefault(f"{name}_first_at", time.time())
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - start

    setattr(owner, name, timed)


def _evict_from_page_cache(path: str) -> bool:
    """Asks the kernel to drop `path`'s cached pages (written back first), so that the next
    read comes from the disk; returns whether the platform offers the request (Linux)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _worker(config: dict) -> None:
    # Imported here: the parent process only starts the replicas and reads their results.
    import torchstrategy as ts
    from torchstrategy.collectives.communicator import Communicator
    from torchstrategy.fault_tolerance.live_recovery import LiveRecovery

    from torchstrategy.fault_tolerance import live_recovery, step_commit

    imported_at = time.time()   # torch (the script's own import) and torchstrategy
    joining = config.get("join") is not None
    # The admission's parts, timed around LiveRecovery's own steps (a joiner's: the wait for
    # the note of a commit, the new group, the state from replica 0 and, within it, the
    # optimizer state's `broadcast_state` (as `_share_state` looks it up) and every
    # `broadcast_` and `broadcast_object`, those within broadcast_state included;
    # replica 0's: its `_admit`).
    parts: dict[str, float] = {}
    if joining:
        for name in ("_wait_for_admission", "_regroup", "_share_state"):
            _timed(LiveRecovery, name, parts)
        _timed(live_recovery, "broadcast_state", parts)
        for name in ("broadcast_", "broadcast_object"):
            _timed(Communicator, name, parts)
    elif not config["restart"]:
        for name in ("_admit", "_regroup"):
            _timed(LiveRecovery, name, parts)
    # The vote's time, measured around each call (this process's votes only).
    vote_seconds: list[float] = []
    decide = step_commit.StepCommit.decide

    def timed_decide(self: step_commit.StepCommit, *args: object, **kwargs: object) -> str:
        start = time.perf_counter()
        try:
            return decide(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            vote_seconds.append(time.perf_counter() - start)

    step_commit.StepCommit.decide = timed_decide  # type: ignore[method-assign]
    strategy = ts.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model(config["state_mb"])
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    width = _width(config["state_mb"])
    g = config["global_batch"]
    built_at = time.time()   # the strategy, the model and its optimizer
    load: dict[str, float] = {}
    if config["restart"]:
        # Twice: from a cold file (its pages dropped from the page cache first, as for a
        # checkpoint written long ago or by another machine: read from the disk), then
        # from the warm file that the first load left in the cache.
        for temperature in ("cold", "warm"):
            if temperature == "cold":
                load["evicted"] = _evict_from_page_cache(config["state_file"])
            start = time.perf_counter()
            state = torch.load(config["state_file"], weights_only=True)
            load[f"torch_load_{temperature}"] = time.perf_counter() - start
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            load[f"local_load_{temperature}"] = time.perf_counter() - start
            del state
    # One committing every k steps, for the timing only (it must not see a loss);
    # made first, so that a joiner joins the one made last.
    every_k = LiveRecovery(strategy, {"model": model, "optimizer": optimizer},
                           global_batch_size=g, min_replicas=1,
                           commit_every=config["commit_every"]) \
        if not config["restart"] and not joining else None
    sparse = LiveRecovery(strategy, {"model": model, "optimizer": optimizer},
                          global_batch_size=g, min_replicas=1,
                          vote_every=config["vote_every"]) \
        if not config["restart"] and not joining else None
    recovery = LiveRecovery(strategy, {"model": model, "optimizer": optimizer},
                            global_batch_size=g, min_replicas=1,
                            failure_detection_seconds=config["detection"],
                            max_replicas=config["replicas"],
                            join=tuple(config["join"]) if joining else None)
    admitted_at = time.time()   # a joiner: admitted, with replica 0's state
    rank = recovery.uid
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(g, width, generator=generator) for _ in range(4)]
    kill_at = None

    def step(x: torch.Tensor) -> None:
        if kill_at is not None and recovery.step == kill_at and rank == config["victim"]:
            with open(config["kill_file"], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    if config["restart"] or joining:
        recovery.run(step, batches[0])
        if rank == 0 or joining:
            with open(config["out"] if not joining else config["join_out"], "w") as f:
                json.dump({"first_step_at": time.time(), "imported_at": imported_at,
                           "built_at": built_at, "admitted_at": admitted_at,
                           "parts": parts, "load": load}, f)
        for _ in range(2 if joining else 0):   # the members' steps after the admission
            recovery.run(step, batches[0])
        return
    times: dict[str, list[float]] = {"plain": [], "live": [], "every_k": [], "sparse": []}
    # The process's CPU time (every thread: the heartbeat's and gloo's too) per step: work
    # added by live recovery shows here whatever the other jobs on the machine do, while
    # the wall time also carries their noise. A vote's wait costs no CPU (it is measured
    # as `votes`).
    cpu: dict[str, list[float]] = {kind: [] for kind in times}
    live_votes: list[float] = []
    paired: dict[str, list[float]] = {"live": [], "every_k": [], "sparse": []}
    cpu_paired: dict[str, list[float]] = {"live": [], "every_k": [], "sparse": []}
    comm = strategy.extended.communicator
    kinds = list(times)
    assert every_k is not None and sparse is not None
    for index in range(config["rounds"] * config["block"]):
        # One step of each kind per iteration, the order rotating: the steps of an
        # iteration see the same load, and their ratios pair them.
        order = kinds[index % len(kinds):] + kinds[:index % len(kinds)]
        x = batches[index % len(batches)]
        taken = {}
        taken_cpu = {}
        run_length = config["steps_per_timing"]
        for kind in order:
            comm.barrier()
            start = time.perf_counter()
            start_cpu = time.process_time()
            for _ in range(run_length):
                if kind == "plain":
                    per = g // comm.world_size
                    strategy.run(step, args=(x[comm.rank * per:(comm.rank + 1) * per],))
                elif kind == "live":
                    votes_before = len(vote_seconds)
                    recovery.run(step, x)
                    live_votes.extend(vote_seconds[votes_before:])
                elif kind == "every_k":
                    every_k.run(step, x)
                else:
                    sparse.run(step, x)
            taken[kind] = (time.perf_counter() - start) / run_length
            taken_cpu[kind] = (time.process_time() - start_cpu) / run_length
        if index >= 3:   # the first iterations warm up (allocations, the probe step)
            for kind in kinds:
                times[kind].append(taken[kind])
                cpu[kind].append(taken_cpu[kind])
            for kind in paired:
                paired[kind].append(taken[kind] / taken["plain"])
                cpu_paired[kind].append(taken_cpu[kind] / taken_cpu["plain"])
    every_k.commit()
    if config["cost_only"]:
        if rank == 0:
            with open(config["out"], "w") as f:
                json.dump({"times": times, "paired": paired, "votes": live_votes,
                           "cpu": cpu, "cpu_paired": cpu_paired}, f)
        recovery.commit()
        return
    kill_at = recovery.step + 2
    done_at = None
    while recovery.step < kill_at + 3:
        recovery.run(step, batches[0])
        if recovery.recoveries and done_at is None:
            done_at = time.time()
    # A joiner (started by the parent once the kill is written) is admitted at a commit;
    # 3 steps with it, then the end (bounded: 10 minutes).
    deadline = time.monotonic() + 600
    while recovery.num_replicas < config["replicas"] and time.monotonic() < deadline:
        recovery.run(step, batches[0])
    for _ in range(3):
        recovery.run(step, batches[0])
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                   config["state_file"])
        with open(config["out"], "w") as f:
            json.dump({"times": times, "paired": paired, "votes": live_votes,
                       "cpu": cpu, "cpu_paired": cpu_paired, "next_step_at": done_at, "admit_seconds": parts.get("_admit"),
                       "noticed_at": parts.get("_regroup_first_at"),
                       "recovery_seconds": recovery.recoveries[0].seconds}, f)


def _start(replicas: int, config: dict, port: int | None = None) -> list[subprocess.Popen]:
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    processes = []
    for rank in range(replicas):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(replicas), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(replicas), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.setdefault("TORCHSTRATEGY_TIMEOUT_SECONDS", "120")
        processes.append(subprocess.Popen([sys.executable, __file__, "--worker",
                                           json.dumps(config)], env=env))
    return processes


def _wait(processes: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    try:
        for process in processes:
            process.wait(max(0.1, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def _print_cost(args: argparse.Namespace, live: dict) -> None:
    plain = _quartiles(live["times"]["plain"])
    load = os.getloadavg()
    print(f"{args.replicas} replicas, MLP with {args.state_mb:g} MiB of training state, "
          f"global batch {args.global_batch}, {args.rounds} rounds of {args.block} timings "
          f"of {args.steps_per_timing} step(s) of each kind, load average "
          f"{load[0]:.1f} / {load[1]:.1f} (1 / 5 min)")
    print(f"step, strategy.run:  median {plain[1] * 1e3:.2f} ms (IQR {plain[0] * 1e3:.2f}-"
          f"{plain[2] * 1e3:.2f})")
    for kind, name in (("live", "recovery.run, commit every step (vote in the step)"),
                       ("every_k", f"recovery.run, commit_every={args.commit_every} "
                                   "(full copy)"),
                       ("sparse", f"recovery.run, vote_every={args.vote_every} (no copy, "
                                  "a vote every that many steps)")):
        q = _quartiles(live["times"][kind])
        ratios = _quartiles(live["paired"][kind])
        print(f"step, {name}: median {q[1] * 1e3:.2f} ms (IQR {q[0] * 1e3:.2f}-"
              f"{q[2] * 1e3:.2f}); overhead {(q[1] / plain[1] - 1) * 100:+.1f} % median "
              f"over median, {(ratios[1] - 1) * 100:+.1f} % paired (median of the "
              f"{len(live['paired'][kind])} steps' ratios to the plain step beside them; "
              f"IQR {(ratios[0] - 1) * 100:+.1f} to {(ratios[2] - 1) * 100:+.1f} %)")
    plain_cpu = _quartiles(live["cpu"]["plain"])
    print(f"CPU time per step (every thread of replica 0), strategy.run: median "
          f"{plain_cpu[1] * 1e3:.2f} ms (IQR {plain_cpu[0] * 1e3:.2f}-{plain_cpu[2] * 1e3:.2f})")
    for kind, name in (("live", "vote in every step"),
                       ("every_k", f"commit_every={args.commit_every}"),
                       ("sparse", f"vote_every={args.vote_every}")):
        q = _quartiles(live["cpu"][kind])
        ratios = _quartiles(live["cpu_paired"][kind])
        print(f"CPU time per step, {name}: median {q[1] * 1e3:.2f} ms; added "
              f"{(ratios[1] - 1) * 100:+.1f} % paired (IQR {(ratios[0] - 1) * 100:+.1f} to "
              f"{(ratios[2] - 1) * 100:+.1f} %)")
    votes = _quartiles(live["votes"])
    print(f"the vote (StepCommit.decide, replica 0): median {votes[1] * 1e3:.3f} ms (IQR "
          f"{votes[0] * 1e3:.3f}-{votes[2] * 1e3:.3f}), {votes[1] / plain[1] * 100:.1f} % "
          "of a step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--state-mb", type=float, default=20.0)
    parser.add_argument("--global-batch", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--detection", type=float, default=2.0)
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--vote-every", type=int, default=10)
    parser.add_argument("--steps-per-timing", type=int, default=1,
                        help="consecutive steps of one kind per timing (the time printed is "
                             "per step): 1 pairs single steps; the vote_every value times "
                             "whole cycles of votes, with no barrier between their steps")
    parser.add_argument("--cost-only", action="store_true",
                        help="measure the per-step cost only (no loss, joiner, restart)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    directory = tempfile.mkdtemp(prefix="bench_recovery_")
    try:
        _run(args, directory)
    finally:
        # The state file is as large as the training state (683 MiB for --state-mb 1024).
        shutil.rmtree(directory, ignore_errors=True)


def _run(args: argparse.Namespace, directory: str) -> None:
    """The four phases (see the module docstring), their files in `directory`."""
    config = {"state_mb": args.state_mb, "global_batch": args.global_batch,
              "rounds": args.rounds, "block": args.block, "detection": args.detection,
              "commit_every": args.commit_every, "vote_every": args.vote_every,
              "steps_per_timing": args.steps_per_timing,
              "replicas": args.replicas,
              "victim": args.replicas - 1, "restart": False, "cost_only": args.cost_only,
              "kill_file": os.path.join(directory, "killed_at"),
              "state_file": os.path.join(directory, "state.pt"),
              "out": os.path.join(directory, "live.json")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    members = _start(args.replicas, config, port)
    if args.cost_only:
        _wait(members, 900)
        with open(config["out"]) as f:
            _print_cost(args, json.load(f))
        return
    # The joiner: a plain process (no launcher's variables), started once the loss
    # happened; from its start to its first step as a replica.
    deadline = time.monotonic() + 600
    while not os.path.exists(config["kill_file"]) and time.monotonic() < deadline \
            and all(p.poll() is None for p in members):
        time.sleep(0.05)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TORCHSTRATEGY_TIMEOUT_SECONDS", "120")
    join_config = dict(config, join=["127.0.0.1", port],
                       join_out=os.path.join(directory, "joined.json"))
    joiner_started = time.time()
    joiner = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(join_config)],
                              env=env)
    _wait(members + [joiner], 600)
    with open(join_config["join_out"]) as f:
        joined = json.load(f)
    with open(config["out"]) as f:
        live = json.load(f)
    with open(config["kill_file"]) as f:
        killed_at = float(f.read())
    _print_cost(args, live)
    print(f"loss of replica {args.replicas - 1} -> next completed step: "
          f"{live['next_step_at'] - killed_at:.2f} s (of which agreement + new group: "
          f"{live['recovery_seconds']:.2f} s)")
    noticed = live["noticed_at"] - killed_at
    print(f"  the loss noticed (a collective broke) {noticed:.2f} s, agreement + new group "
          f"{live['recovery_seconds']:.2f} s (the lost replica's heartbeat stale for "
          f"--detection={args.detection:g} s in it), then the step redone "
          f"{live['next_step_at'] - killed_at - noticed - live['recovery_seconds']:.2f} s")
    parts = joined["parts"]
    admission = joined["admitted_at"] - joined["built_at"]
    transfer = parts["_regroup"] + parts["_share_state"]
    print(f"a joiner (a fresh process: import, strategy, admission at a commit, the state "
          f"from replica 0) -> its first step: {joined['first_step_at'] - joiner_started:.2f} s")
    print(f"  import of torch and torchstrategy {joined['imported_at'] - joiner_started:.2f} s"
          f", strategy + model {joined['built_at'] - joined['imported_at']:.2f} s, "
          f"admission {admission:.2f} s (LiveRecovery(join=...) to its return), first step "
          f"{joined['first_step_at'] - joined['admitted_at']:.2f} s")
    optimizer_state = parts.get("broadcast_state", 0.0)
    print(f"  admission: waiting for a commit {admission - transfer:.2f} s, new group "
          f"{parts['_regroup']:.2f} s, state from replica 0 {parts['_share_state']:.2f} s "
          f"(the parameters, buffers (broadcast_) and counters (broadcast_object) "
          f"{parts['_share_state'] - optimizer_state:.2f} s, the optimizer state "
          f"(broadcast_state: its structure by broadcast_object, its tensors by broadcast_) "
          f"{optimizer_state:.2f} s; in all, broadcast_ {parts.get('broadcast_', 0.0):.2f} s, "
          f"broadcast_object {parts.get('broadcast_object', 0.0):.2f} s); replica 0 paused "
          f"{live['admit_seconds']:.2f} s for it (its _admit)")
    restart_config = dict(config, restart=True, out=os.path.join(directory, "restart.json"))
    started = time.time()
    _wait(_start(args.replicas - 1, restart_config), 600)
    with open(restart_config["out"]) as f:
        restart = json.load(f)
    load = restart["load"]
    print(f"restart of {args.replicas - 1} fresh processes (import, group, model, local "
          f"state file, one step): {restart['first_step_at'] - started:.2f} s")
    warm, cold = load["local_load_warm"], load["local_load_cold"]
    size = os.path.getsize(config["state_file"]) / 2 ** 20
    print(f"  import {restart['imported_at'] - started:.2f} s, strategy + model "
          f"{restart['built_at'] - restart['imported_at']:.2f} s, local load from the cold "
          f"file {cold:.2f} s (torch.load of the {size:.0f} MiB file "
          f"{load['torch_load_cold']:.2f} s, then load_state_dict"
          f"{'' if load['evicted'] else '; not evicted: no posix_fadvise here'}), "
          f"LiveRecovery + first step "
          f"{restart['first_step_at'] - restart['built_at'] - cold - warm:.2f} s")
    print(f"  the same load again from the warm file (in the page cache): {warm:.2f} s "
          f"(torch.load {load['torch_load_warm']:.2f} s)")
    for name, seconds in (("cold", cold), ("warm", warm)):
        print(f"admission / local load from the {name} file: {admission / seconds:.2f} x "
              f"(target 1.5 x); without the wait for a commit (new group + state): "
              f"{transfer / seconds:.2f} x")

if __name__ == "__main__":
    main()
