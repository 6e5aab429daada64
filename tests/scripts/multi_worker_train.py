"""One "machine" of the multi-worker tests: ``multi_worker_train.py MODE OUTDIR [REPLICAS]``.

Started by two torchrun agents (``--nnodes=2``), or as ``python multi_worker_train.py`` with
TF_CONFIG (then REPLICAS is the number of CPU replicas on this machine). Each replica writes
``OUTDIR/<mode>-rank<R>.pt``.

MODE:
  train       the core equivalence training (tests/core/test_equivalence.py's model and
              data, SGD with momentum) under MultiWorkerMirroredStrategy, once with the
              default all-reduce and once with HierarchicalCopyAllReduce, plus explicit
              sums through the hierarchical op; records the strategy's facts.
  backup      training with ts.BackupAndRestore (dropout, a shuffling DataLoader, the seed
              differing between attempts); with KILL_AT_STEP set, the replica of rank
              $KILL_RANK SIGKILLs itself at that global step on the first attempt. Replica 0
              writes the global step reached to OUTDIR/progress after each step; each step
              ends with a sleep of $STEP_SLEEP seconds (default 0).
  sharded     ShardedStrategy with hybrid sharding (shard within this machine's replicas,
              replicate across machines) trains tests/sharded's MLP like one device
              (within $ATOL, default 1e-5); records the placements and the mesh.
  train+sharded  "train", then "sharded" in the same processes (one start for both: the
              several-machines tests). Each part runs under its own try/except: one that
              raises writes its traceback to OUTDIR/<part>-rank<R>.error and the other
              still runs; the process then exits 1.
  peer_death  the replica of rank 1 dies (SIGKILL) after a few steps; the others carry on.
  peer_hang   the replica of rank 1 stops taking part (sleeps) after a few steps.
"""
import logging
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torchstrategy as ts  # noqa: E402
from tests.core.test_equivalence import l2_term, make_data, make_model  # noqa: E402

if os.environ.get("TEST_LOG_LEVEL"):   # to see the library's INFO records (its choices)
    logging.basicConfig(level=os.environ["TEST_LOG_LEVEL"])

mode, outdir = sys.argv[1], sys.argv[2]
devices = [f"cpu:{i}" for i in range(int(sys.argv[3]))] if len(sys.argv) > 3 else None


def save(result, strategy, name=None):
    rank = strategy.extended.replica_id
    torch.save(result, os.path.join(outdir, f"{name or mode}-rank{rank}.pt"))


def train_equivalence(strategy):
    rank, n = strategy.extended.replica_id, strategy.num_replicas_in_sync
    torch.manual_seed(1000 + rank)   # different on every replica until the scope broadcasts
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(xb, yb, global_batch):
        per_example = F.cross_entropy(model(xb), yb, reduction="none")
        loss = ts.compute_average_loss(per_example, global_batch_size=global_batch)
        loss = loss + ts.scale_regularization_loss(l2_term(model))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = []
    for x, y in make_data():
        xb, yb = torch.tensor_split(x, n)[rank], torch.tensor_split(y, n)[rank]
        per_replica = strategy.run(step, args=(xb, yb, x.shape[0]))
        losses.append(strategy.reduce("SUM", per_replica, axis=None).item())
    return {"final": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": losses}


def facts(strategy):
    return {"task_type": strategy.task_type, "task_id": strategy.task_id,
            "is_chief": strategy.is_chief, "worker_index": strategy.worker_index,
            "num_workers": strategy.num_workers, "replicas": strategy.num_replicas_in_sync,
            "rank": strategy.extended.replica_id, "pid": os.getpid()}


def hierarchical_sums(strategy, ops):
    """Sums of known per-replica buffers through the hierarchical op, several sizes and
    dtypes, next to a plain all-reduce of the same buffers."""
    rank = strategy.extended.replica_id
    out = []
    for size, dtype in [(1, torch.float32), (7, torch.float64), (1000, torch.float32),
                        (33, torch.int64)]:
        mine = (torch.arange(size) * (rank + 1) + rank).to(dtype)
        via_hierarchy = ops.all_reduce(mine.clone(), None)
        plain = mine.clone()
        dist.all_reduce(plain)
        out.append((via_hierarchy, plain))
    return out


def train_mode():
    result = {}
    strategy = ts.MultiWorkerMirroredStrategy(devices=devices)
    result["facts"] = facts(strategy)
    result["default"] = train_equivalence(strategy)
    ops = ts.HierarchicalCopyAllReduce()
    hierarchical = ts.MultiWorkerMirroredStrategy(devices=devices, cross_device_ops=ops)
    result["num_machines"] = ops.num_machines
    result["hierarchical"] = train_equivalence(hierarchical)
    result["sums"] = hierarchical_sums(hierarchical, ops)
    save(result, strategy, "train")


def sharded_mode():
    # Hybrid sharding across the machines: shard within a machine (its 2 replicas),
    # replicate across machines. check_equal_to_one_device asserts the losses and the
    # exported weights against one device on every replica.
    from tests.sharded.test_sharded import check_equal_to_one_device

    strategy = ts.ShardedStrategy(devices=devices, shard_group_size=len(devices or [0, 0]))
    model, _, _ = check_equal_to_one_device(strategy, "mlp",
                                            atol=float(os.environ.get("ATOL", "1e-5")))
    parameter = next(model.parameters())
    save({"placements": [type(p).__name__ for p in parameter.placements],
          "mesh": parameter.device_mesh.mesh.tolist(),
          "replicas": strategy.num_replicas_in_sync}, strategy, "sharded")


if mode == "train":
    train_mode()

elif mode == "train+sharded":
    failed = False
    for part, run in (("train", train_mode), ("sharded", sharded_mode)):
        try:
            run()
        except Exception:
            failed = True
            who = dist.get_rank() if dist.is_initialized() else f"-pid{os.getpid()}"
            with open(os.path.join(outdir, f"{part}-rank{who}.error"), "w") as f:
                f.write(traceback.format_exc())
            traceback.print_exc()
    sys.exit(1 if failed else 0)

elif mode == "backup":
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A different seed on every attempt: only what the backup restores makes the resumed
    # run continue the interrupted one (model init, shuffling seed, dropout masks).
    torch.manual_seed(4321 + 17 * attempt)
    strategy = ts.MultiWorkerMirroredStrategy(devices=devices)
    rank = strategy.extended.replica_id
    with strategy.scope():
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g),
                                          torch.randint(0, 3, (48,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    dist_data = strategy.experimental_distribute_dataset(loader)

    def step(batch):
        x, y = batch
        per_example = F.cross_entropy(model(x), y, reduction="none")
        loss = ts.compute_average_loss(per_example, global_batch_size=8)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    backup = ts.BackupAndRestore(os.path.join(outdir, "backup"), save_freq=4)
    backup.track(model=model, optimizer=optimizer)
    kill_at = int(os.environ.get("KILL_AT_STEP", "-1"))
    kill_rank = int(os.environ.get("KILL_RANK", "1"))
    for epoch in backup.epochs(3):
        for step_in_epoch, batch in backup.steps(dist_data):
            if attempt == 0 and backup.global_step == kill_at and rank == kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)   # mid-training, no clean-up
            strategy.run(step, args=(batch,))
            if rank == 0:   # how far training got (the network-fault tests cut a link then)
                with open(os.path.join(outdir, "progress"), "w") as f:
                    f.write(str(backup.global_step))
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
    save({"final": {k: v.detach().clone() for k, v in model.state_dict().items()},
          "attempt": attempt, "restored": backup.restored,
          "backup_left": os.path.exists(backup.path)}, strategy)

elif mode == "sharded":
    sharded_mode()

elif mode in ("peer_death", "peer_hang"):
    strategy = ts.MultiWorkerMirroredStrategy(devices=devices)
    rank = strategy.extended.replica_id
    with strategy.scope():
        model = nn.Linear(4, 1)
    for i in range(100):
        if i == 3 and rank == 1:
            if mode == "peer_death":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(120)
        strategy.run(lambda: model(torch.ones(2, 4)).sum().backward())
    print("finished all steps", flush=True)

else:
    raise SystemExit(f"unknown mode {mode!r}")
