"""One replica of an elastic job, started by tests/fault_tolerance/test_elastic_resize.py.

    python -m torch.distributed.run --nnodes=1:2 ... elastic_train.py OUT_DIR [options]
    python elastic_train.py OUT_DIR          (one process: the single-device reference)

MultiWorkerMirroredStrategy training under ts.BackupAndRestore, backed up after every step:
a machine that is lost gives no notice, so only a backup written before it went away can be
resumed from. Every replica process appends one line per finished step to
OUT_DIR/steps.<pid>: the number of replicas, its rank, the global step, the time (seconds
since the epoch) and the indices of the samples it trained on. Replica 0 saves the final
parameters to OUT_DIR/final.pt.

``--slow S`` sleeps S seconds in each of the first ``--slow-steps`` steps, except in a job
of one replica resumed from a backup: time for the test to kill a machine mid-epoch, and
for the second machine to join if the first round began without it. ``--hold-at N`` makes a
job of ONE replica wait after step N (at most ``--hold-seconds``, then it goes on) for
torchrun to stop it: the surviving agent stops its worker when a new machine joins the
rendezvous, and the job grows back.
"""
import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy as ts

GLOBAL_BATCH = 6
SAMPLES = 48
EPOCHS = 3


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=generator, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64) + 0.1
    return TensorDataset(x, y, torch.arange(SAMPLES))


def loader():
    # The loader's own generator fixes the order of every epoch whatever the number of
    # replicas; the global batch (6) divides into 1, 2 or 3 equal per-replica batches.
    return DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=True,
                      generator=torch.Generator().manual_seed(7))


def hold(log, seconds):
    """Waits (at most `seconds`) for torchrun to stop this worker. Called before a step:
    the previous step is backed up by then (`steps` writes it before the next batch)."""
    log.write(f"hold {time.time():.3f}\n")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--slow-steps", type=int, default=0)
    parser.add_argument("--hold-at", type=int, default=-1)
    parser.add_argument("--hold-seconds", type=float, default=60.0)
    args = parser.parse_args(argv)
    distributed = "TORCHELASTIC_RUN_ID" in os.environ
    strategy = ts.MultiWorkerMirroredStrategy() if distributed else ts.get_strategy()
    replicas = strategy.num_replicas_in_sync
    rank = strategy.extended.replica_id if distributed else 0
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(4, 1, dtype=torch.float64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dist_data = strategy.experimental_distribute_dataset(loader())

    def replica_step(x, y):
        per_example = ((model(x) - y) ** 2).squeeze(1)
        loss = ts.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    log = open(os.path.join(args.out, f"steps.{os.getpid()}"), "a", buffering=1)
    backup = ts.BackupAndRestore(os.path.join(args.out, "backup"), save_freq=1)
    backup.track(model=model, optimizer=optimizer)
    for _ in backup.epochs(EPOCHS):
        for _, batch in backup.steps(dist_data):
            if distributed and replicas == 1 and backup.global_step == args.hold_at:
                hold(log, args.hold_seconds)
            if (replicas > 1 or not backup.restored) and backup.global_step < args.slow_steps:
                time.sleep(args.slow)
            strategy.run(replica_step, args=batch[:2])
            indices = strategy.experimental_local_results(batch[2])[0].tolist()
            log.write(f"{replicas} {rank} {backup.global_step + 1} {time.time():.3f} "
                      f"{' '.join(map(str, indices))}\n")
    log.close()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                   os.path.join(args.out, "final.pt"))


if __name__ == "__main__":
    main()
