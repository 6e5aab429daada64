"""ShardedStrategy with models built on the meta device (deferred initialisation).

Three launches (1, 2 and 4 replicas) check that:
- a model built under ``torch.device("meta")`` inside the scope is sharded, each replica
  holding real shards of 1/N of every parameter, and gets exactly the initial values of
  the documented one-device procedure (``to_empty``, then each module with parameters or
  buffers of its own initialised in ``model.modules()`` order from the same seed): the
  same values for 1, 2 and 4 replicas (on a hybrid 2x2 mesh, with CPU offload), by each module's
  ``reset_parameters()`` or by ``ShardedStrategy(init_fn=...)``;
- training on from there equals one device (Adam, 1e-5);
- errors, raised on every replica before any collective (the launches would hang
  otherwise): a module with parameters of its own and no ``reset_parameters()`` (named,
  with the fix: init_fn), a model partly on meta, and a port that kept its own
  ``fully_shard`` calls inside the scope.

And examples/sharded_transformer.py, which builds its model on meta, runs with no warning.
"""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import torchstrategy as ts
from tests.helpers import ROOT
from tests.helpers.replicas import assert_same_tensors, launch

pytestmark = pytest.mark.timeout(240)

SEED = 11
GLOBAL_BATCH = 4
STEPS = 2
WIDTH, VOCAB, LENGTH = 8, 16, 5


class Scale(nn.Module):
    """A module with a buffer of its own, set by reset_parameters."""

    def __init__(self):
        super().__init__()
        self.register_buffer("factor", torch.empty(WIDTH))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.factor, 0.5, 1.5)

    def forward(self, x):
        return x * self.factor


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Parameters of its own (`position`, 5 rows: uneven over 2 and 4 replicas), repeated
    blocks (the units), a buffer, and modules of torch with reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.empty(LENGTH, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.scale = Scale()
        self.head = nn.Linear(WIDTH, VOCAB)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.scale(x)).flatten(0, 1)


class TorchLayers(nn.Module):
    """torch's TransformerEncoderLayer: its MultiheadAttention has parameters of its own
    and no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=16, dropout=0.0,
                                       batch_first=True) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).flatten(0, 1)


def init_attention(module):
    """An init_fn: MultiheadAttention's own parameters as its constructor sets them,
    every other module by its reset_parameters()."""
    if isinstance(module, nn.MultiheadAttention):
        nn.init.xavier_uniform_(module.in_proj_weight)
        nn.init.zeros_(module.in_proj_bias)
    else:
        module.reset_parameters()


def one_device_initial(cls, init_fn=None):
    """The documented procedure on one device: the meta model materialised whole, each
    module with parameters or buffers of its own initialised in model.modules() order."""
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = cls()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                (init_fn or type(module).reset_parameters)(module)
    return model


def data():
    g = torch.Generator().manual_seed(SEED)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH * LENGTH,), generator=g))
            for _ in range(STEPS)]


def one_device_trained():
    model = one_device_initial(Net)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for tokens, targets in data():
        F.cross_entropy(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def exported(strategy, model):
    # A copy: on one replica the export may share storage with the live parameters.
    return {k: v.clone() for k, v in strategy.extended.export_state_dict(model).items()}


def meta_model(strategy, cls=Net):
    torch.manual_seed(SEED)
    with strategy.scope():
        with torch.device("meta"):
            model = cls()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def initial_and_trained(strategy):
    """The initial values and those after STEPS Adam steps, both exported (the chief's
    full ones), and the fraction of the parameters this replica holds."""
    model, optimizer = meta_model(strategy)
    assert all(isinstance(p, DTensor) and not p.to_local().is_meta
               for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    held = sum(p.to_local().numel() for p in model.parameters()) / \
        sum(p.numel() for p in model.parameters())
    initial = exported(strategy, model)
    n = strategy.num_replicas_in_sync

    def step(tokens, targets):
        rows = targets.shape[0]  # this replica's rows of the flattened targets
        loss = F.cross_entropy(model(tokens), targets, reduction="sum") / (
            GLOBAL_BATCH * LENGTH)
        assert rows == GLOBAL_BATCH * LENGTH // n
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for tokens, targets in strategy.experimental_distribute_dataset(data()):
        strategy.run(step, args=(tokens, targets))
    return initial, exported(strategy, model), held


def error_of(fn):
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


def without_reset_parameters():
    meta_model(ts.ShardedStrategy(), TorchLayers)


def partly_on_meta():
    strategy = ts.ShardedStrategy()
    with strategy.scope():
        with torch.device("meta"):
            model = Net()
        model.head = nn.Linear(WIDTH, VOCAB)  # with values


def own_fully_shard():
    strategy = ts.ShardedStrategy()
    with strategy.scope():
        with torch.device("meta"):
            model = Net()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)


def replica(case):
    out = {"sharded": initial_and_trained(ts.ShardedStrategy())}
    if case == 4:
        out["hybrid"] = initial_and_trained(ts.ShardedStrategy(shard_group_size=2))
    if case == 2:
        out["offload"] = initial_and_trained(ts.ShardedStrategy(cpu_offload=True))
        strategy = ts.ShardedStrategy(init_fn=init_attention)
        model, _ = meta_model(strategy, TorchLayers)
        out["init_fn"] = exported(strategy, model)
        out["errors"] = {name: error_of(fn) for name, fn in [
            ("reset_parameters", without_reset_parameters),
            ("partly", partly_on_meta), ("fully_shard", own_fully_shard)]}
    return out


def test_meta_models_get_the_same_values_on_any_number_of_replicas():
    initial = {k: v.detach().clone() for k, v in one_device_initial(Net).state_dict().items()}
    trained = one_device_trained()
    results = {n: launch(replica, n, n=n) for n in (1, 2, 4)}
    runs = [(n, kind, result) for n, out in results.items() for kind, result in out.items()
            if kind in ("sharded", "hybrid", "offload")]
    assert [(n, kind) for n, kind, _ in runs] == [
        (1, "sharded"), (2, "sharded"), (2, "offload"), (4, "sharded"), (4, "hybrid")]
    for n, kind, (start, end, held) in runs:
        # Exactly the one-device values, whatever the replicas; each holds 1/N.
        assert_same_tensors(start, initial, what=f"initial values, {n} replicas, {kind}")
        assert held == pytest.approx(1 / 2 if kind == "hybrid" else 1 / n, abs=0.02), held
        assert_same_tensors(end, trained, atol=1e-5, what=f"trained, {n} replicas, {kind}")

    reference = one_device_initial(TorchLayers, init_attention).state_dict()
    assert_same_tensors(results[2]["init_fn"], reference, what="init_fn")

    errors = results[2]["errors"]
    assert "TorchLayers was built on the meta device" in errors["reset_parameters"]
    assert "'layers.0.self_attn' (MultiheadAttention)" in errors["reset_parameters"]
    assert "no reset_parameters()" in errors["reset_parameters"]
    assert "ShardedStrategy(init_fn=fn)" in errors["reset_parameters"]
    assert "on the meta device and others that hold values (head.weight (cpu)" in \
        errors["partly"]
    assert "remove your fully_shard calls; ShardedStrategy shards" in errors["fully_shard"]
    assert "blocks.0" in errors["fully_shard"]
    assert "attached to" not in errors["fully_shard"]  # the old, wrong diagnosis


def test_init_fn_must_be_callable():
    with pytest.raises(TypeError, match=r"init_fn=3"):
        ts.ShardedStrategy(init_fn=3)


def run_script(*argv):
    """Runs `python argv...` from the repository root as a user would (2 CPU replicas
    re-executed by the script itself); returns (stdout, stderr) after checking the exit
    status."""
    env = dict(os.environ, TORCHSTRATEGY_TIMEOUT_SECONDS="60", PYTHONUNBUFFERED="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHSTRATEGY_LAUNCHER",
                 "TORCHSTRATEGY_PARENT_PID"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout, result.stderr


@pytest.mark.timeout(300)
def test_the_example_builds_on_meta_and_warns_nothing():
    stdout, stderr = run_script(os.path.join("examples", "sharded_transformer.py"),
                                "--steps", "2", "--replicas", "2")
    assert "replica 0 holds" in stdout, stdout
    assert "Warning" not in stderr, stderr[-4000:]


@pytest.mark.timeout(300)
def test_the_memory_benchmark_runs_quick():
    """scripts/bench_sharded_memory.py --quick (a tiny model on 2 replicas): the figures
    the full run reports, for every replica (the full run is not a test: ~9 GB)."""
    stdout, stderr = run_script(os.path.join("scripts", "bench_sharded_memory.py"),
                                "--quick")
    assert "16 B/parameter" in stdout and "baseline (import torch, torchstrategy)" in stdout
    rows = re.findall(r"^\s+([01])\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+[0-9.-]+\s+"
                      r"[0-9.-]+$", stdout, flags=re.MULTILINE)
    assert rows == ["0", "1"], stdout
    assert "largest (peak - baseline) / full training state" in stdout, stdout
    assert "MirroredStrategy (not run)" in stdout, stdout
    assert "Warning" not in stderr, stderr[-4000:]
