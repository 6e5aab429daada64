"""Seconds per training step of one LightningModule under Trainer(strategy="mirrored")
(torchstrategy) and under Lightning's own strategy="ddp", measured side by side.

    python scripts/bench_lightning.py            # 2 CPU replicas (GPUs when there are)
    python scripts/bench_lightning.py --quick    # a few steps, to check it runs

Each configuration runs as its own `python` program (both strategies start the second
replica by running the command again), alternately for --rounds rounds; the best round of
each is reported, with the ratio ours / ddp (target <= 1.0). The module is an MLP whose
gradient all-reduce is a sizeable part of the step, so the reducers are what differ.
"""
import argparse
import os
import re
import subprocess
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quick", action="store_true", help="a few steps only")
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--worker", choices=["mirrored", "ddp"], help=argparse.SUPPRESS)
parser.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
WARMUP_STEPS = 5


def worker(args):
    import lightning.pytorch as pl
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import torchstrategy.lightning  # noqa: F401  registers strategy="mirrored"

    class MLP(pl.LightningModule):
        def __init__(self, width=1024, depth=6):
            super().__init__()
            layers = []
            for _ in range(depth):
                layers += [nn.Linear(width, width), nn.ReLU()]
            self.net = nn.Sequential(*layers, nn.Linear(width, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepTimer(pl.Callback):
        def __init__(self):
            self.start = self.cpu_start = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == WARMUP_STEPS:
                self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_end(self, trainer, module):
            if trainer.is_global_zero:
                steps = args.steps - WARMUP_STEPS
                seconds = (time.perf_counter() - self.start) / steps
                cpu = (time.process_time() - self.cpu_start) / steps
                print(f"RESULT {args.worker} {seconds:.6f} {cpu:.6f} "
                      f"threads={torch.get_num_threads()}", flush=True)

    pl.seed_everything(0)
    n = 64 * args.steps
    data = TensorDataset(torch.randn(n, 1024), torch.randint(0, 10, (n,)))
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = pl.Trainer(strategy=args.worker, accelerator=accelerator, devices=args.devices,
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[StepTimer()])
    # 64 examples per replica per step
    trainer.fit(MLP(), DataLoader(data, batch_size=64))


def run_config(config, steps, devices):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", config,
                             "--steps", str(steps), "--devices", str(devices)],
                            env=env, capture_output=True, text=True, timeout=600)
    found = re.search(rf"^RESULT {config} ([0-9.]+) ([0-9.]+)", result.stdout,
                      flags=re.MULTILINE)
    if result.returncode != 0 or not found:
        sys.exit(f"{config} failed ({result.returncode}):\n{result.stdout[-2000:]}\n"
                 f"{result.stderr[-4000:]}")
    return float(found.group(1)), float(found.group(2))


def main():
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    steps = 10 if args.quick else 60
    rounds = 1 if args.quick else args.rounds
    wall = {"mirrored": float("inf"), "ddp": float("inf")}
    cpu = dict(wall)
    for _ in range(rounds):
        for config in wall:
            seconds, cpu_seconds = run_config(config, steps, args.devices)
            wall[config] = min(wall[config], seconds)
            cpu[config] = min(cpu[config], cpu_seconds)
    print(f"seconds per step, {args.devices} replicas, MLP 6x1024 (25 MiB of gradients), 64 "
          f"examples per replica ({steps - WARMUP_STEPS} timed steps, best of {rounds})")
    print("configuration                wall s/step  replica-0 CPU s/step")
    print(f"ours (strategy='mirrored')   {wall['mirrored']:.5f}      {cpu['mirrored']:.5f}")
    print(f"ddp  (strategy='ddp')        {wall['ddp']:.5f}      {cpu['ddp']:.5f}")
    print(f"ours / ddp                   {wall['mirrored'] / wall['ddp']:.3f}        "
          f"{cpu['mirrored'] / cpu['ddp']:.3f}")


if __name__ == "__main__":
    main()
