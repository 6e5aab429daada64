"""The strategy contract is enough: a strategy defined here, in the test file alone, works
with every part of the library that takes a strategy, though no line of the library names
it.

`ZeroOneStrategy` is ZeRO-1 data parallelism, written as a third parameter handling (the
library has `MirroredParameters` and `ShardedParameters`): parameters are mirrored and
gradients summed as under MirroredStrategy (`ZeroOneParameters` extends
`MirroredParameters`), but each replica keeps the optimizer state of only its slice of the
parameters, steps that slice and broadcasts it. It differs from every strategy of the
library in its capabilities (``Capabilities(converts_checkpoint_state=True)``): its
optimizer state is partitioned, so its checkpoints go through the contract's
`state_dict_for_checkpoint` / `load_state_dict_from_checkpoint` (which gather the full
state, laid out as one process's optimizer would lay it out), and a Trainer's optimizers
are partitioned through `prepare_trainer_optimizer`.

One launch of two replicas checks, in order: ``strategy.adopt``, ``ts.compute_average_loss``
outside ``run`` (the global batch size found by a collective), ``ts.metrics.sync``,
``ts.checkpoint``, ``ts.BackupAndRestore``, ``ts.PreemptionCheckpointHandler`` (a real
SIGTERM on replica 0) and the Lightning adapter, comparing weights and optimizer state with
single-process training on the same global batches.
"""
import dataclasses
import os
import signal

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from tests.helpers.replicas import assert_same_tensors, detached_state, launch
from torchstrategy.strategies.capabilities import Capabilities
from torchstrategy.strategies.data_parallel import DataParallelStrategy
from torchstrategy.strategies.parameters import MirroredParameters

N = 2                 # replicas
B = 8                 # global batch
CUSTOM_STEPS = 3      # steps of the custom loop before the checkpoints
PREEMPTION_STEPS = 3  # steps under the preemption handler
LIGHTNING_STEPS = 2
SEED = 1234           # replica r builds its model with SEED + r; replica 0's is broadcast
D_IN, D_HIDDEN, D_OUT = 4, 8, 2
TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}  # halves summed vs one batch: rounding only


# -- the new strategy ---------------------------------------------------------------------
@dataclasses.dataclass
class _Partition:
    """Attached to a partitioned optimizer: every parameter group's parameters (all
    replicas') and the replica that steps each."""

    groups: list
    owners: list


class ZeroOneParameters(MirroredParameters):
    """Mirrored parameters, summed gradients (`MirroredParameters`); optimizer state
    partitioned: parameter i (counted over all groups) is stepped by replica ``i % N``,
    which then broadcasts it."""

    @property
    def replica_id(self):
        return self.extended.replica_id

    @property
    def num_replicas_in_sync(self):
        return self.extended.num_replicas_in_sync

    def adopt(self, module, optimizer=None):
        module = super().adopt(module, optimizer)
        if optimizer is not None:
            self.partition(optimizer)
        return module

    def prepare_trainer_optimizer(self, optimizer, module):
        self.partition(optimizer)

    def partition(self, optimizer):
        """Keeps in `optimizer` only the parameters this replica steps (dropping the state
        of the others) and makes each ``step()`` end with the broadcast of every slice
        (and drop the gradients of the others)."""
        if hasattr(optimizer, "zero_one"):
            return
        rank, world = self.replica_id, self.num_replicas_in_sync
        groups = [list(group["params"]) for group in optimizer.param_groups]
        owners, start = [], 0
        for params in groups:
            owners.append([(start + i) % world for i in range(len(params))])
            start += len(params)
        for group, params, owned_by in zip(optimizer.param_groups, groups, owners):
            group["params"] = [p for p, owner in zip(params, owned_by) if owner == rank]
            for p, owner in zip(params, owned_by):
                if owner != rank:
                    optimizer.state.pop(p, None)
        optimizer.zero_one = _Partition(groups, owners)
        optimizer.register_step_post_hook(self._broadcast_slices)

    def _broadcast_slices(self, optimizer, args, kwargs):
        partition = optimizer.zero_one
        for params, owned_by in zip(partition.groups, partition.owners):
            for p, owner in zip(params, owned_by):
                if owner != self.replica_id:
                    # The owner stepped it; ``zero_grad()`` reaches only this replica's
                    # slice, and a gradient left here would be summed again next step.
                    p.grad = None
        for src in range(self.num_replicas_in_sync):
            self.communicator.broadcast_(
                [p for params, owned_by in zip(partition.groups, partition.owners)
                 for p, owner in zip(params, owned_by) if owner == src], src=src)

    def state_dict_for_checkpoint(self, obj, model=None):
        """A partitioned optimizer's full state, numbered as one process's optimizer over
        all the parameters numbers it (a collective); anything else's ``state_dict()``."""
        partition = getattr(obj, "zero_one", None)
        if partition is None:
            return obj.state_dict()
        local = obj.state_dict()
        mine, groups, global_index, local_index = {}, [], 0, 0
        for saved, params, owned_by in zip(local["param_groups"], partition.groups,
                                           partition.owners):
            groups.append({**saved, "params": list(range(global_index,
                                                         global_index + len(params)))})
            for owner in owned_by:
                if owner == self.replica_id:
                    if local_index in local["state"]:
                        mine[global_index] = local["state"][local_index]
                    local_index += 1
                global_index += 1
        state = {}
        for part in self.communicator.gather_objects(mine):
            state.update(part)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict_from_checkpoint(self, obj, state_dict, model=None):
        partition = getattr(obj, "zero_one", None)
        if partition is None:
            obj.load_state_dict(state_dict)
            return
        state, groups, local_index = {}, [], 0
        for saved, owned_by in zip(state_dict["param_groups"], partition.owners):
            indices = []
            for owner, global_index in zip(owned_by, saved["params"]):
                if owner == self.replica_id:
                    if global_index in state_dict["state"]:
                        state[local_index] = state_dict["state"][global_index]
                    indices.append(local_index)
                    local_index += 1
            groups.append({**saved, "params": indices})
        obj.load_state_dict({"state": state, "param_groups": groups})


class ZeroOneStrategy(DataParallelStrategy):
    """ZeRO-1 over one replica per process (under ``ts.launch`` or torchrun)."""

    # An optimizer's own state_dict() holds this replica's slice only.
    CAPABILITIES = Capabilities(converts_checkpoint_state=True)

    def __init__(self, devices=None):
        super().__init__(lambda process: ZeroOneParameters(), devices=devices,
                         timeout_seconds=60, cross_device_ops=ts.NcclAllReduce())


# -- the model, the data and the single-process reference -------------------------------
def make_model():
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT))


def make_optimizer(model):
    return torch.optim.Adam(model.parameters(), lr=0.05)


def make_data(steps):
    """The first `steps` global batches' rows (the same rows whatever `steps`)."""
    rows = (CUSTOM_STEPS + PREEMPTION_STEPS) * B
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(rows, D_IN, generator=g), torch.randn(rows, D_OUT, generator=g)
    return x[:steps * B], y[:steps * B]


def global_batches(steps, offset=0):
    x, y = make_data(offset + steps)
    return list(zip(x.split(B), y.split(B)))[offset:]


def reference(steps):
    """Single-process training: the weights and Adam's state after each step (index k:
    after k steps), and the final model."""
    torch.manual_seed(SEED)
    model = make_model()
    optimizer = make_optimizer(model)
    weights, states = [detached_state(model)], [optimizer.state_dict()]
    for x, y in global_batches(steps):
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        weights.append(detached_state(model))
        states.append(_cloned(optimizer.state_dict()))
    return weights, states, model


def _cloned(state_dict):
    return {"state": {i: {k: v.clone() for k, v in s.items()}
                      for i, s in state_dict["state"].items()},
            "param_groups": [dict(g) for g in state_dict["param_groups"]]}


def _assert_same_optimizer_state(ours, theirs, what):
    assert ours["param_groups"] == theirs["param_groups"], what
    assert sorted(ours["state"]) == sorted(theirs["state"]), what
    for index in theirs["state"]:
        assert_same_tensors(ours["state"][index], theirs["state"][index], **TOLERANCE,
                            what=f"{what} state[{index}]")


# -- the replicas ---------------------------------------------------------------------------
def _train_step(model, optimizer, rank, x, y):
    """One DDP-style step outside ``run``: this replica's slice of the global batch, the
    loss scaled by ``compute_average_loss`` (the global batch size found by a collective)."""
    xs, ys = x.tensor_split(N)[rank], y.tensor_split(N)[rank]
    per_example = F.mse_loss(model(xs), ys, reduction="none").mean(dim=1)
    ts.compute_average_loss(per_example).backward()
    optimizer.step()
    optimizer.zero_grad()


def _fresh(strategy, rank):
    """A model and optimizer built outside any scope (another init on every replica),
    adopted."""
    torch.manual_seed(SEED + 100 + rank)
    model = make_model()
    optimizer = make_optimizer(model)
    strategy.adopt(model, optimizer)
    return model, optimizer


def _replica(directory):
    import torchmetrics

    strategy = ZeroOneStrategy()
    ext = strategy.extended
    rank = ext.replica_id
    out = {}

    # adopt + compute_average_loss outside run: replica 0's init, the global gradient.
    torch.manual_seed(SEED + rank)
    model = make_model()
    optimizer = make_optimizer(model)
    assert strategy.adopt(model, optimizer) is model
    for x, y in global_batches(CUSTOM_STEPS):
        _train_step(model, optimizer, rank, x, y)
    out["custom"] = detached_state(model)
    out["optimizer_entries"] = ext.communicator.gather_objects(len(optimizer.state))

    # metrics.sync: each replica updates with its rows inside run; compute() sees all rows.
    metric = ts.metrics.sync(torchmetrics.MeanSquaredError(), strategy)
    x, y = make_data(CUSTOM_STEPS)
    with torch.no_grad():
        strategy.run(lambda xs, ys: metric.update(model(xs), ys),
                     args=(x.tensor_split(N)[rank], y.tensor_split(N)[rank]))
    out["mse"] = metric.compute().item()

    # ts.checkpoint: model and the gathered optimizer state, written by the chief, loaded
    # into a fresh adopted pair on every replica.
    path = os.path.join(directory, "checkpoint.pt")
    ts.checkpoint.save({"model": model.state_dict(),
                        "optimizer": ext.state_dict_for_checkpoint(optimizer)}, path)
    loaded = ts.checkpoint.load(path)
    out["checkpoint_optimizer"] = loaded["optimizer"]
    model2, optimizer2 = _fresh(strategy, rank)
    model2.load_state_dict(loaded["model"])
    ext.load_state_dict_from_checkpoint(optimizer2, loaded["optimizer"])
    out["checkpoint_reloaded"] = (detached_state(model2),
                                  ext.state_dict_for_checkpoint(optimizer2))

    # BackupAndRestore: backed up, then restored into another fresh pair.
    backup_dir = os.path.join(directory, "backup")
    backup = ts.BackupAndRestore(backup_dir)
    backup.track(model=model, optimizer=optimizer)
    backup.save()
    model3, optimizer3 = _fresh(strategy, rank)
    restored = ts.BackupAndRestore(backup_dir)
    restored.track(model=model3, optimizer=optimizer3)
    out["backup_restored"] = (restored.restored, detached_state(model3),
                              ext.state_dict_for_checkpoint(optimizer3))

    # PreemptionCheckpointHandler: replica 0 gets SIGTERM; every replica saves at the step
    # they agree on; a new handler restores that checkpoint into a fresh pair.
    exits = []
    config = ts.TerminationConfig(exit_fn=lambda: exits.append("exit"))
    preemption_dir = os.path.join(directory, "preemption")
    handler = ts.PreemptionCheckpointHandler(
        None, {"model": model, "optimizer": optimizer}, preemption_dir, config)
    with handler.watch_preemption_scope():
        for step, (x, y) in enumerate(global_batches(PREEMPTION_STEPS, CUSTOM_STEPS)):
            if step == 1 and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            handler.run(_train_step, model, optimizer, rank, x, y)
    model4, optimizer4 = _fresh(strategy, rank)
    resumed = ts.PreemptionCheckpointHandler(
        None, {"model": model4, "optimizer": optimizer4}, preemption_dir, config)
    with resumed.watch_preemption_scope():
        pass  # restored already; the scope's end stops its watcher
    out["preemption"] = (exits, resumed.restored, resumed.total_run_calls,
                         detached_state(model4), ext.state_dict_for_checkpoint(optimizer4))

    out["lightning"] = _lightning(strategy, rank, directory)
    return out


def _lightning(strategy, rank, directory):
    """Trainer(strategy=LightningStrategy(ZeroOneStrategy)): weights and the checkpoint's
    optimizer state after LIGHTNING_STEPS steps (Lightning averages gradients over replicas:
    the global batch's mean, as in the reference)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(SEED + rank)  # replica 0's init is broadcast
            self.net = make_model()

        def training_step(self, batch, batch_index):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return make_optimizer(self.net)

    module = Tiny()
    # Replica r's loader gives slice r of each global batch of the reference.
    slices = [(x.tensor_split(N)[rank], y.tensor_split(N)[rank])
              for x, y in global_batches(LIGHTNING_STEPS)]
    loader = DataLoader(TensorDataset(torch.cat([x for x, _ in slices]),
                                      torch.cat([y for _, y in slices])), batch_size=B // N)
    trainer = pl.Trainer(strategy=ts.LightningStrategy(strategy), accelerator="cpu",
                         max_steps=LIGHTNING_STEPS, use_distributed_sampler=False,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, loader)
    path = os.path.join(directory, "lightning.ckpt")
    trainer.save_checkpoint(path)
    entries = strategy.extended.communicator.gather_objects(len(trainer.optimizers[0].state))
    checkpoint = torch.load(path, weights_only=False) if rank == 0 else None
    return (detached_state(module.net), entries,
            checkpoint and checkpoint["optimizer_states"][0])


# -- the test -------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_strategy_defined_outside_the_library_works_everywhere(tmp_path):
    out = launch(_replica, str(tmp_path), n=N)
    weights, states, _ = reference(CUSTOM_STEPS + PREEMPTION_STEPS)
    params = len(list(make_model().parameters()))

    # adopt + compute_average_loss: single-process training; each replica holds the Adam
    # state of its half of the parameters only.
    assert_same_tensors(out["custom"], weights[CUSTOM_STEPS], **TOLERANCE, what="custom")
    assert out["optimizer_entries"] == [params // N] * N

    # metrics.sync: the MSE over every replica's rows.
    _, _, model = reference(CUSTOM_STEPS)
    x, y = make_data(CUSTOM_STEPS)
    with torch.no_grad():
        assert out["mse"] == pytest.approx(F.mse_loss(model(x), y).item(), rel=1e-5)

    # ts.checkpoint holds the full state, as one process's Adam lays it out, and it loads.
    _assert_same_optimizer_state(out["checkpoint_optimizer"], states[CUSTOM_STEPS],
                                 "ts.checkpoint")
    reloaded_model, reloaded_optimizer = out["checkpoint_reloaded"]
    assert_same_tensors(reloaded_model, weights[CUSTOM_STEPS], **TOLERANCE, what="reloaded")
    _assert_same_optimizer_state(reloaded_optimizer, states[CUSTOM_STEPS], "reloaded")

    # BackupAndRestore.
    was_restored, backup_model, backup_optimizer = out["backup_restored"]
    assert was_restored
    assert_same_tensors(backup_model, weights[CUSTOM_STEPS], **TOLERANCE, what="backup")
    _assert_same_optimizer_state(backup_optimizer, states[CUSTOM_STEPS], "backup")

    # PreemptionCheckpointHandler: saved once at the agreed step, restored exactly.
    exits, was_restored, run_calls, preempted_model, preempted_optimizer = out["preemption"]
    assert exits == ["exit"] and was_restored
    # SIGTERM reaches replica 0 (its Python handler runs in the main thread) before its
    # second run, with 1 step finished: it claims "save after step 2" (c + 1).
    assert run_calls == 2
    step = CUSTOM_STEPS + run_calls
    assert_same_tensors(preempted_model, weights[step], **TOLERANCE, what="preemption")
    _assert_same_optimizer_state(preempted_optimizer, states[step], "preemption")

    # Lightning: the Trainer's optimizer partitioned, training and checkpoint as one process.
    lightning_weights, entries, lightning_optimizer = out["lightning"]
    weights, states, _ = reference(LIGHTNING_STEPS)
    assert entries == [params // N] * N
    assert_same_tensors(lightning_weights, weights[LIGHTNING_STEPS], **TOLERANCE,
                        what="lightning")
    _assert_same_optimizer_state(lightning_optimizer, states[LIGHTNING_STEPS], "lightning")
