"""Training under a PreemptionCheckpointHandler, started by tests/cluster/test_slurm_real.py.

    srun -n2 python slurm_train.py OUT_DIR [--slow SECONDS]        (a SLURM step of 2 tasks)
    srun -n1 torchrun --nproc-per-node=2 ... slurm_train.py OUT_DIR  (torchrun in the step)
    python slurm_train.py OUT_DIR                                   (one process: the reference)

``--global-batch N`` (default 6) sets the global batch (a multiple of the replicas).
``--backup-every N`` trains under ts.BackupAndRestore (a backup every N steps, in
OUT_DIR/backup) instead of the handler.

The strategy finds the cluster by itself (no resolver is named): a step of several tasks
gives SlurmClusterResolver, torchrun's variables TorchElasticClusterResolver. Every replica
writes OUT_DIR/resolver<r> (the resolver's class and the number of replicas), and appends
one line per finished step to OUT_DIR/rank<r>.log: the attempt (SLURM's restart count plus
torchrun's), the step, and the indices of the samples it trained on. At the start of each
attempt it writes OUT_DIR/started<r>.<attempt> (its pid and hostname). Steps sleep ``--slow`` seconds in the first
attempt (time for a test to preempt the job mid-epoch). Replica 0 saves the final
parameters to OUT_DIR/final.pt; the checkpoint lives in OUT_DIR/ckpt.
"""
import argparse
import os
import socket
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy as ts

GLOBAL_BATCH = 6
SAMPLES = 48
EPOCHS = 2


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1
    return TensorDataset(x, y, torch.arange(SAMPLES))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--backup-every", type=int, default=0)
    args = parser.parse_args(argv)
    attempt = (int(os.environ.get("SLURM_RESTART_COUNT", "0"))
               + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    slow = args.slow if attempt == 0 else 0.0
    distributed = ("TORCHELASTIC_RUN_ID" in os.environ
                   or int(os.environ.get("SLURM_NTASKS", "1")) > 1)
    strategy = ts.MultiWorkerMirroredStrategy() if distributed else ts.get_strategy()
    rank = strategy.extended.replica_id if distributed else 0
    resolver = strategy.cluster_resolver if distributed else None
    with open(os.path.join(args.out, f"resolver{rank}"), "w") as f:
        f.write(f"{type(resolver).__name__} {strategy.num_replicas_in_sync}\n")
    with open(os.path.join(args.out, f"started{rank}.{attempt}"), "w") as f:
        f.write(f"{os.getpid()} {socket.gethostname()}")
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(4, 1, dtype=torch.float64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dist_data = strategy.experimental_distribute_dataset(
        DataLoader(data(), batch_size=args.global_batch, shuffle=True,
                   generator=torch.Generator().manual_seed(7)))

    def replica_step(x, y):
        per_example = ((model(x) - y) ** 2).squeeze(1)
        loss = ts.compute_average_loss(per_example, global_batch_size=args.global_batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def train_step(batch):
        strategy.run(replica_step, args=batch[:2])
        time.sleep(slow)

    def record(log, steps_done, batch):
        indices = strategy.experimental_local_results(batch[2])[0].tolist()
        log.write(f"{attempt} {steps_done} {' '.join(map(str, indices))}\n")

    if args.backup_every:
        backup = ts.BackupAndRestore(os.path.join(args.out, "backup"),
                                     save_freq=args.backup_every)
        backup.track(model=model, optimizer=optimizer)
        with open(os.path.join(args.out, f"rank{rank}.log"), "a", buffering=1) as log:
            for _ in backup.epochs(EPOCHS):
                for _, batch in backup.steps(dist_data):
                    train_step(batch)
                    record(log, backup.global_step + 1, batch)
        save_final(rank, model, args.out)
        return
    handler = ts.PreemptionCheckpointHandler(
        resolver, {"model": model, "optimizer": optimizer, "data": dist_data},
        os.path.join(args.out, "ckpt"))
    steps = len(dist_data)
    with open(os.path.join(args.out, f"rank{rank}.log"), "a", buffering=1) as log, \
            handler.watch_preemption_scope():
        for epoch in range(handler.total_run_calls // steps, EPOCHS):
            dist_data.set_epoch(epoch, handler.total_run_calls % steps)
            for batch in dist_data:
                handler.run(train_step, batch)
                record(log, handler.total_run_calls, batch)
    save_final(rank, model, args.out)


def save_final(rank, model, out):
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main()
