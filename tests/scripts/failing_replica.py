"""A re-executed job in which one replica fails (issue 36, items 8 and 9):
`python failing_replica.py MODE [OUTDIR]`.

MODE:
  sharded_keyerror   ShardedStrategy; replica 1 raises KeyError at its second step while
                     replica 0 goes on into FSDP2's collectives.
  sharded_keyerror_slow_exit
                     the same, and replica 1's exit handlers then take 60 s (an experiment
                     tracker's final upload): its connections close long before it exits.
  sharded_keyerror_own_excepthook
                     the same, replica 1 having set its own sys.excepthook (so it writes no
                     note of its exception), and its exit handlers take 3 s.
  init_fn_raises     ShardedStrategy(init_fn=...) on a model built on meta; the function
                     raises on replica 1 only.
  launch_blocked     ts.launch of 2 replicas: replica 0 waits in a collective, replica 1
                     sleeps; each writes OUTDIR/pid<rank> (the test interrupts replica 0).
  reexec_blocked     the same, re-executed (replica 0 is this process).
  torchrun_blocked   under torchrun (2 workers): each replica waits to receive from the
                     other, a deadlock in gloo; each writes OUTDIR/pid<rank> (the test sends
                     SIGINT to the whole job, as Ctrl-C in a terminal does).
  launch_then_idle   writes OUTDIR/launcher_temp_dir (its /tmp/pymp-* directory), runs a
                     ts.launch of 2 replicas to its end, writes OUTDIR/idle and sleeps
                     (the test sends SIGTERM).
  launch_compile     ts.launch of 2 replicas that each run one torch.compile'd step.
"""
import atexit
import multiprocessing.util
import os
import sys
import time

import torch

import torchstrategy as ts

mode = sys.argv[1] if len(sys.argv) > 1 else None


def init_fn(module):
    if strategy.extended.replica_id == 1:
        raise ValueError("init_fn fails on replica 1 on purpose")
    module.reset_parameters()


def blocked(outdir, devices=None):
    strategy = ts.MirroredStrategy(devices=devices)
    rank = strategy.extended.replica_id
    with open(os.path.join(outdir, f"pid{rank}.part"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(outdir, f"pid{rank}.part"), os.path.join(outdir, f"pid{rank}"))
    if rank == 1:
        time.sleep(300)
    strategy.reduce("SUM", torch.ones(2))


def deadlocked(outdir):
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    write(outdir, f"pid{rank}", str(os.getpid()))
    torch.distributed.recv(torch.zeros(1), src=1 - rank)   # both wait: neither sends


def one():
    return 1


def compiled_step():
    strategy = ts.MirroredStrategy()
    with strategy.scope():
        model = torch.nn.Linear(4, 2)
    compiled = torch.compile(model)
    strategy.run(lambda: compiled(torch.ones(2, 4)).sum().backward())
    return 1


def sharded_keyerror(exit_handler_seconds=0.0, own_excepthook=False):
    if os.environ.get("RANK") == "1" and exit_handler_seconds:
        # Registered before the strategy's: it runs after the process group is released.
        atexit.register(time.sleep, exit_handler_seconds)
    strategy = ts.ShardedStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rid = strategy.extended.replica_id
    if rid == 1 and own_excepthook:
        sys.excepthook = lambda kind, value, tb: print(f"my hook: {kind.__name__}",
                                                       file=sys.stderr)
    for step in range(4):
        if step == 1 and rid == 1:
            {}["learning_rate"]   # a KeyError on one replica
        strategy.run(lambda: model(torch.ones(4, 8)).sum().backward())
        optimizer.step()
        optimizer.zero_grad()


def write(outdir, name, text):
    with open(os.path.join(outdir, name + ".part"), "w") as f:
        f.write(text)
    os.replace(os.path.join(outdir, name + ".part"), os.path.join(outdir, name))


if __name__ == "__main__":
    if mode == "launch_compile":
        print(ts.launch(compiled_step, num_replicas=2))
    elif mode == "launch_then_idle":
        write(sys.argv[2], "launcher_temp_dir", multiprocessing.util.get_temp_dir())
        ts.launch(one, num_replicas=2)
        write(sys.argv[2], "idle", "")
        time.sleep(300)
    elif mode == "launch_blocked":
        ts.launch(blocked, sys.argv[2], num_replicas=2)
    elif mode == "reexec_blocked":
        blocked(sys.argv[2], devices=["cpu:0", "cpu:1"])
    elif mode == "torchrun_blocked":
        deadlocked(sys.argv[2])
    elif mode == "sharded_keyerror":
        sharded_keyerror()
    elif mode == "sharded_keyerror_slow_exit":
        sharded_keyerror(exit_handler_seconds=60)
    elif mode == "sharded_keyerror_own_excepthook":
        sharded_keyerror(exit_handler_seconds=3, own_excepthook=True)
    elif mode == "init_fn_raises":
        strategy = ts.ShardedStrategy(devices=["cpu:0", "cpu:1"], init_fn=init_fn)
        with strategy.scope():
            with torch.device("meta"):
                model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        strategy.run(lambda: model(torch.ones(4, 8)).sum().backward())
    else:
        raise SystemExit(f"unknown mode {mode!r}")
