"""`python ddp_environment.py MODE OUTDIR`: a DDP-style program's view of its world.

MODE: reexec (a plain ``python`` run asking for two CPU replicas) | torchrun (one replica
per process torchrun started) | alone (one CPU replica, as the default strategy of a
machine without GPUs has). Each replica writes OUTDIR/replica<N>.json with what `report` returns; ``ts.launch``
calls `report` itself.
"""
import json
import os
import subprocess
import sys

import torch.distributed as dist
from torch.utils.data import DistributedSampler

import torchstrategy as ts

VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "GROUP_RANK", "ROLE_RANK")


def report(devices=None):
    """Builds a MirroredStrategy on `devices` and returns what DDP-style code would read:
    torchrun's variables, nanoGPT's and minGPT's ways of reading them, torch.distributed's
    answers and a DistributedSampler's indices."""
    before = {name: os.environ.get(name) for name in VARIABLES}
    strategy = ts.MirroredStrategy(devices=devices)
    sampler = DistributedSampler(list(range(10)), shuffle=False)
    dist.barrier()
    return {
        "env_before": before,
        "env": {name: os.environ.get(name) for name in VARIABLES},
        "nanogpt_ddp": int(os.environ.get("RANK", -1)) != -1,   # nanoGPT's train.py
        "mingpt_local_rank": int(os.environ["LOCAL_RANK"]),     # minGPT-ddp's trainer
        "replica_id": strategy.extended.replica_id,
        "replicas": strategy.num_replicas_in_sync,
        "dist": [dist.is_initialized(), dist.get_rank(), dist.get_world_size()],
        "sampler": list(sampler),
    }


def every_report():
    """`report` on every replica of ``ts.launch``'s two, gathered (launch returns replica
    0's result only)."""
    mine = report()
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, mine)
    return reports


def _child_sees_a_launcher():
    """Whether a program this one starts (same environment) takes its inherited variables
    for a launcher's world."""
    code = "from torchstrategy.launch import world; print(world.from_environment() is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.strip() == "True"


if __name__ == "__main__":
    mode, outdir = sys.argv[1], sys.argv[2]
    devices = {"reexec": ["cpu:0", "cpu:1"], "alone": ["cpu:0"], "torchrun": None}[mode]
    result = report(devices)
    if mode == "alone":
        result["child_sees_a_launcher"] = _child_sees_a_launcher()
    with open(os.path.join(outdir, f"replica{result['replica_id']}.json"), "w") as f:
        json.dump(result, f)
