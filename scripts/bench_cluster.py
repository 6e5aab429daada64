"""Gradient sync between two machines, each with its own shaped link: the topology measured.

Two "machines" of a cluster of network namespaces (tests/helpers/cluster.py: a bridge,
each node's end of its veth shaped with tc tbf at ``--rates`` Gbit/s, so each node has its
own full-duplex link), two CPU replicas (gloo) on each: 4 replicas, ranks 0-1 on node0 and
2-3 on node1. Traffic between the replicas of one node stays on that node (its loopback);
only what crosses between the nodes goes through the shaped links. Needs root (namespaces,
tc); refuses with the reason otherwise.

Each repetition syncs the gradients of a GPT-2-block-shaped model (``--blocks`` blocks of
QKV 2304x768, projection 768x768, MLP 3072x768 and 768x3072, LayerNorms, biases; 7.1M
parameters, 27 MiB per block): a loss whose backward hands out fixed gradients (no model
compute; the gradients set to None before each, as `optimizer.zero_grad()` does), so the
time is the gradient reduction. Configurations, in the same 4 processes,
alternating in rotating order, each repetition timed on the slowest replica:

  limit           one contiguous all-reduce of all the gradients' bytes between the two
                  machines alone (ranks 0 and 2): the least any exact sync must send across
  flat            one contiguous all-reduce over the 4 replicas (gloo's ring: the ring
                  crosses each node's link in one direction, 1.5x the bytes of the limit)
  hier            the same buffer through ts.HierarchicalCopyAllReduce() directly: reduce
                  onto each node's first replica, all-reduce between those two, broadcast
                  (inside each node through shared memory, the default with gloo)
  hier-tcp        the same with shared_memory=False: inside each node over loopback TCP
  ddp-best        DistributedDataParallel(gradient_as_bucket_view=True, static_graph=True,
                  broadcast_buffers=False)
  ours            ts.MultiWorkerMirroredStrategy() with the default cross-device ops
  ours-flat       the same with ts.NcclAllReduce() named (a flat ring)
  ours-hier       ts.HierarchicalCopyAllReduce(): summed inside each node, all-reduced
                  between the two nodes' first replicas, broadcast back
  ours-hier-tcp   the same with shared_memory=False (inside each node over loopback TCP)
  ours-hier-4mb   the same with buckets of 4 MiB (CommunicationOptions(bytes_per_pack=4 MiB))
                  instead of 25: a bucket reaches the link sooner
  ours-bf16       ts.NcclAllReduce(compression="bf16")
  ours-powersgd4  ts.NcclAllReduce(compression=ts.PowerSGD(rank=4))
  ours-int8       ts.NcclAllReduce(compression=ts.Int8())

For each, node0's link counters (bytes node0 sent through eth0) give the bytes a sync
puts on the link. Ratios are the median (quartiles) over repetitions of per-repetition
ratios of configurations measured back to back ("/ ours": against the default).

``--configs`` measures only some of them (with ``limit`` and ``ddp-best``, the references);
``--trace`` prints, for one repetition of ``ours-hier`` on node0's leader, when each bucket
was handed to the hierarchical ops and how long waiting for it took (where the time of the
reducer path goes).

    sudo nice -n 10 .venv/bin/python scripts/bench_cluster.py              # 2 and 10 Gbit/s
    sudo .venv/bin/python scripts/bench_cluster.py --rates 2 --quick       # seconds
    sudo .venv/bin/python scripts/bench_cluster.py --rates 2 --configs flat,hier,ours-flat,ours-hier --trace
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from given_gradients import GivenGradients  # scripts/given_gradients.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torchstrategy as ts  # noqa: E402
from tests.helpers.cluster import Cluster, why_not_possible  # noqa: E402

CONFIGS = ("limit", "flat", "hier", "hier-tcp", "ddp-best", "ours", "ours-flat", "ours-hier",
           "ours-hier-tcp", "ours-hier-4mb", "ours-bf16", "ours-powersgd4", "ours-int8")
OURS = {"ours": None, "ours-flat": "flat", "ours-hier": "hier", "ours-hier-tcp": "hier-tcp",
        "ours-hier-4mb": "hier-4mb",
        "ours-bf16": "bf16", "ours-powersgd4": "powersgd", "ours-int8": "int8"}
NPROC = 2


def shapes(blocks, quick):
    d = 192 if quick else 768
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,),
             (d,), (d,), (d,), (d,)]
    return block * blocks


class Gradients(nn.Module):
    """A module whose forward uses every parameter (so DDP's static graph sees them all)
    and whose backward gives them the fixed gradients."""

    def __init__(self, shape_list, grads):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shape_list])
        self.grads = grads

    def forward(self):
        return GivenGradients.apply(self.grads, *self.ps)


def tx_bytes():
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def our_strategy(kind, trace=False):
    cross = {None: None, "flat": ts.NcclAllReduce(),
             "hier": Traced() if trace else ts.HierarchicalCopyAllReduce(),
             "hier-tcp": ts.HierarchicalCopyAllReduce(shared_memory=False),
             "hier-4mb": ts.HierarchicalCopyAllReduce(),
             "bf16": ts.NcclAllReduce(compression="bf16"),
             "powersgd": ts.NcclAllReduce(compression=ts.PowerSGD(rank=4)),
             "int8": ts.NcclAllReduce(compression=ts.Int8())}[kind]
    options = ts.CommunicationOptions(bytes_per_pack=4 << 20) if kind == "hier-4mb" else None
    strategy = ts.MultiWorkerMirroredStrategy(communication_options=options,
                                              cross_device_ops=cross)
    ops = strategy.extended.communicator.cross_device_ops
    if kind in ("hier", "hier-tcp", "hier-4mb") and ops.num_machines != 2:
        raise SystemExit(f"the hierarchical ops see {ops.num_machines} machine(s), not 2")
    return strategy


class Traced(ts.HierarchicalCopyAllReduce):
    """The hierarchical ops, recording each buffer's hand-over and the wait for it:
    (event, bucket, bytes, seconds since the repetition began)."""

    def __init__(self):
        super().__init__()
        self.events = []
        self.origin = time.perf_counter()

    def all_reduce_async(self, flat, group):
        index = sum(1 for e in self.events if e[0] == "handed over")
        self.events.append(("handed over", index, flat.numel() * flat.element_size(),
                            time.perf_counter() - self.origin))
        handle = super().all_reduce_async(flat, group)
        events, origin = self.events, self.origin

        class Handle:
            def wait(self, timeout=None):
                start = time.perf_counter() - origin
                handle.wait(timeout)
                events.append(("waited", index, start, time.perf_counter() - origin))
                return True
        return Handle()


def worker(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timeout)
    torch.set_num_threads(1)
    shape_list = shapes(args.blocks, args.quick)
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(s, generator=gen) for s in shape_list]
    total = sum(g.numel() for g in grads)
    flat = torch.randn(total, generator=gen)
    leaders = dist.new_group([0, NPROC])
    hierarchical = ts.HierarchicalCopyAllReduce()
    hierarchical.create_groups([r // NPROC for r in range(world)])
    if rank == 0:
        print(f"hier: inside each node through "
              f"{'shared memory' if hierarchical.uses_shared_memory else 'loopback TCP'}",
              flush=True)
    hierarchical_tcp = ts.HierarchicalCopyAllReduce(shared_memory=False)
    hierarchical_tcp.create_groups([r // NPROC for r in range(world)])
    configs = {
        "limit": lambda: dist.all_reduce(flat, group=leaders) if rank % NPROC == 0 else None,
        "flat": lambda: dist.all_reduce(flat),
        "hier": lambda: hierarchical.all_reduce(flat, None),
        "hier-tcp": lambda: hierarchical_tcp.all_reduce(flat, None),
    }
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    ddp = nn.parallel.DistributedDataParallel(
        Gradients(shape_list, grads), gradient_as_bucket_view=True, static_graph=True,
        broadcast_buffers=False)

    # Every sync starts from gradients set to None, as after `optimizer.zero_grad()` (its
    # default) in a training loop: without it, each backward would add onto the last sum,
    # which the strategy's reducer keeps aside and adds back (so that only the new
    # gradients are summed), a copy and an add that DDP does not make and no training loop
    # asks for.
    def ddp_sync():
        ddp.zero_grad(set_to_none=True)
        ddp().backward()
    configs["ddp-best"] = ddp_sync
    strategies = {}
    for name, kind in OURS.items():
        if name not in args.configs and name != "ours":
            continue
        strategy = strategies[name] = our_strategy(kind, trace=args.trace)
        with strategy.scope():
            module = Gradients(shape_list, grads)

        def sync(strategy=strategy, module=module):
            module.zero_grad(set_to_none=True)
            strategy.run(lambda: module().backward())
        configs[name] = sync
    chosen = type(strategies["ours"].extended.communicator.cross_device_ops).__name__
    names = [n for n in configs if n in args.configs]
    for name in names:                      # warm-up (DDP's static graph needs two)
        for _ in range(args.warmup):
            configs[name]()
    times = {n: [] for n in names}
    sent = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            before = tx_bytes()
            start = time.perf_counter()
            configs[name]()
            elapsed = time.perf_counter() - start
            dist.barrier()
            sent[name].append(tx_bytes() - before)
            times[name].append(elapsed)
    if args.trace and "ours-hier" in names:
        ops = strategies["ours-hier"].extended.communicator.cross_device_ops
        ops.events.clear()
        dist.barrier()
        ops.origin = time.perf_counter()
        configs["ours-hier"]()
        whole = time.perf_counter() - ops.origin
        lines = [f"trace of one ours-hier sync on rank {rank} ({whole * 1e3:.1f} ms in all; "
                 f"the last bucket handed over is the step's flags):"]
        for event in ops.events:
            if event[0] == "handed over":
                lines.append(f"  {event[3] * 1e3:8.1f} ms  bucket {event[1]:>2} handed over "
                             f"({event[2] / 2**20:.2f} MiB)")
            else:
                lines.append(f"  {event[2] * 1e3:8.1f} ms  bucket {event[1]:>2} waited for "
                             f"{(event[3] - event[2]) * 1e3:.1f} ms")
        if rank in (0, 1):
            print("\n".join(lines), flush=True)
    table = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(args.worker, "w") as f:
            json.dump({"times": {n: table[k].tolist() for k, n in enumerate(names)},
                       "sent": sent, "bytes": total * 4, "default": chosen}, f)
    dist.barrier()
    dist.destroy_process_group()


def quartiles(xs):
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def fmt(q, scale=1.0, digits=2):
    lo, mid, hi = (v * scale for v in q)
    return f"{mid:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def run_rate(rate, args):
    nodes = Cluster(2, hostname_resolves_to="address", rate=f"{rate}gbit")
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    procs = []
    try:
        nodes.start()
        port = 29511
        for rank in range(2 * NPROC):
            node = nodes.nodes[rank // NPROC]
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(2 * NPROC),
                       LOCAL_RANK=str(rank % NPROC), LOCAL_WORLD_SIZE=str(NPROC),
                       GROUP_RANK=str(rank // NPROC), MASTER_ADDR=nodes.nodes[0].address,
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       TORCHSTRATEGY_TIMEOUT_SECONDS="600", PYTHONPATH=ROOT)
            argv = [sys.executable, os.path.abspath(__file__), "--worker", out,
                    "--blocks", str(args.blocks), "--repeats", str(args.repeats),
                    "--warmup", str(args.warmup), "--configs", ",".join(sorted(args.configs))]
            argv += (["--quick"] if args.quick else []) + (["--trace"] if args.trace else [])
            procs.append(subprocess.Popen(node.command(argv), env=env, cwd=ROOT))
        codes = [p.wait(args.timeout) for p in procs]
        if any(codes):
            raise SystemExit(f"a replica failed at {rate} Gbit/s: exit codes {codes}")
        with open(out) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        nodes.close()
        os.unlink(out)


def report(rate, result):
    times, sent = result["times"], result["sent"]
    mib = result["bytes"] / 2 ** 20
    print(f"\n== {rate} Gbit/s per node link: 2 nodes x {NPROC} replicas, {mib:.1f} MiB of "
          f"gradients, {len(times['limit'])} repetitions; the default cross-device ops: "
          f"{result['default']}")
    print(f"{'configuration':<16}{'ms median (q1-q3)':>24}{'/ limit':>22}{'/ ddp-best':>22}"
          f"{'/ ours':>22}{'MiB node0 sent':>16}")
    for name in [n for n in CONFIGS if n in times]:
        t = times[name]
        vs = [[a / b for a, b in zip(t, times[other])]
              for other in ("limit", "ddp-best", "ours")]
        print(f"{name:<16}{fmt(quartiles(t), 1e3, 1):>24}"
              + "".join(f"{fmt(quartiles(v)):>22}" for v in vs)
              + f"{statistics.median(sent[name]) / 2**20:>16.1f}")
    return {name: statistics.median([a / b for a, b in zip(times[name], times["ddp-best"])])
            for name in CONFIGS if name in times}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2,10", help="Gbit/s per node link, comma-separated")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated configurations (limit, ddp-best and ours always)")
    parser.add_argument("--trace", action="store_true",
                        help="print one ours-hier sync's timeline on node0's replicas")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    args.configs = set(args.configs.split(",")) | {"limit", "ddp-best", "ours"}
    if args.worker:
        return worker(args)
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 4), 2
    reason = why_not_possible()
    if reason is not None or subprocess.run(["which", "tc"], capture_output=True).returncode:
        raise SystemExit(f"bench_cluster: cannot run here: {reason or 'no tc (iproute2)'}")
    load = os.getloadavg()
    print(f"bench_cluster: load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the "
          f"start, {os.cpu_count()} cores; torch {torch.__version__}")
    for rate in (float(r) for r in args.rates.split(",")):
        rate_label = f"{rate:g}"
        ratios = report(rate_label, run_rate(rate_label, args))
        if rate == 2 and "ours-hier" in ratios:
            verdict = "met" if ratios["ours-hier"] <= 0.75 else "NOT met"
            print(f"target at 2 Gbit/s, ours-hier <= 0.75 x ddp-best: {ratios['ours-hier']:.2f}"
                  f" ({verdict})")
    load = os.getloadavg()
    print(f"bench_cluster: load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")


if __name__ == "__main__":
    main()
