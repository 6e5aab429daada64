"""Replica functions of tests/sharded/test_checkpoint_matrix.py (ts.launch imports them by
name): every checkpoint path under every strategy, interrupted and resumed.

One launch saves every cell (strategy x path) after `STOP` of `STEPS` steps; a later
launch, on the same or another number of replicas, resumes every cell from its checkpoint
with freshly seeded (wrong) weights and runs the remaining steps. Each cell returns the
final weights and Adam state as plain CPU tensors keyed by parameter name, which the test
compares with one device's uninterrupted run (`reference`).
"""
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy as ts

STRATEGIES = ("mirrored", "multi_worker", "sharded")
PATHS = ("checkpoint", "backup", "preemption")
GLOBAL_BATCH = 6
STEPS = 6
STOP = 3          # steps run before the interruption
LR = 0.01


def data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(GLOBAL_BATCH * STEPS, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH * STEPS, 3, generator=generator, dtype=torch.float64)
    return TensorDataset(x, y)


def loader():
    return DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=False)


def build_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8, dtype=torch.float64), nn.Tanh(),
                         nn.Linear(8, 3, dtype=torch.float64))


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).sum(1)


def reference():
    """One device, no strategy, all `STEPS` steps: (weights, Adam state by name)."""
    model = build_model(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in loader():
        loss = loss_of(model, x, y).sum() / GLOBAL_BATCH
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return plain_weights(model), adam_by_name(model, optimizer.state_dict())


def plain_weights(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def adam_by_name(model, state_dict):
    """{parameter name: {step, exp_avg, exp_avg_sq}} from an optimizer state_dict keyed by
    index (torch's) or by name (ShardedStrategy's state_dict_for_checkpoint)."""
    names = [name for name, _ in model.named_parameters()]
    out = {}
    for key, value in state_dict["state"].items():
        name = names[key] if isinstance(key, int) else key
        out[name] = {k: torch.as_tensor(v).detach().cpu().clone().to(torch.float64)
                     for k, v in value.items()}
    return out


def make_strategy(name):
    if name == "mirrored":
        return ts.MirroredStrategy()
    if name == "multi_worker":
        return ts.MultiWorkerMirroredStrategy()
    return ts.ShardedStrategy()


class _Preempted(Exception):
    """Raised by the handler's exit_fn: the save is done, this attempt stops here."""


def _exit():
    raise _Preempted()


class Cell:
    """One strategy, its model (Adam) and distributed data, for one checkpoint path."""

    def __init__(self, strategy_name, seed):
        self.strategy = make_strategy(strategy_name)
        with self.strategy.scope():
            self.model = build_model(seed)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR)
        self.data = self.strategy.experimental_distribute_dataset(loader())

    def step(self, batch):
        def replica_step(x, y):
            loss = ts.compute_average_loss(loss_of(self.model, x, y),
                                           global_batch_size=GLOBAL_BATCH)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            return loss
        return self.strategy.run(replica_step, args=batch)

    def result(self):
        """Weights and Adam state, full, on every replica (a collective)."""
        ext = self.strategy.extended
        weights = ext.state_dict_for_checkpoint(self.model)
        optimizer = ext.state_dict_for_checkpoint(self.optimizer)
        if dist.get_rank() != 0:
            return None
        names = [name for name, _ in self.model.named_parameters()]
        # The sharded model's parameter names (keys of its name-keyed optimizer state) are
        # the plain model's.
        assert set(names) == set(weights), (names, list(weights))
        return ({k: v.detach().cpu().clone() for k, v in weights.items()},
                adam_by_name(self.model, optimizer))


# -- the paths: save after STOP steps (first launch), resume and finish (second) ------------
def _checkpoint_save(cell, directory):
    ext = cell.strategy.extended
    for step, batch in enumerate(cell.data):
        if step == STOP:
            break
        cell.step(batch)
    refused = None
    if isinstance(cell.strategy, ts.ShardedStrategy):
        # The plain state_dicts hold DTensors, of which the chief has only its shards:
        # refused on every replica, naming the key and the call to use.
        try:
            ts.checkpoint.save({"model": cell.model.state_dict()},
                               os.path.join(directory, "plain.pt"))
        except TypeError as error:
            refused = str(error)
        assert not os.path.exists(os.path.join(directory, "plain.pt"))
    # The documented single-file checkpoint under any strategy: the contract gathers a
    # sharded model / optimizer (every replica calls it), the chief writes.
    state = {"model": ext.state_dict_for_checkpoint(cell.model),
             "optimizer": ext.state_dict_for_checkpoint(cell.optimizer), "step": STOP}
    ts.checkpoint.save(state, os.path.join(directory, "ckpt.pt"))
    return refused


def _checkpoint_resume(cell, directory):
    ext = cell.strategy.extended
    state = ts.checkpoint.load(os.path.join(directory, "ckpt.pt"))
    ext.load_state_dict_from_checkpoint(cell.model, state["model"])
    ext.load_state_dict_from_checkpoint(cell.optimizer, state["optimizer"])
    cell.data.set_epoch(0, state["step"])
    for batch in cell.data:
        cell.step(batch)


def _backup_loop(cell, directory, stop_at):
    backup = ts.BackupAndRestore(os.path.join(directory, "backup"), save_freq=1,
                                 delete_checkpoint=False)
    backup.track(model=cell.model, optimizer=cell.optimizer)
    for _ in backup.epochs(1):
        for _, batch in backup.steps(cell.data):
            if backup.global_step == stop_at:
                return
            cell.step(batch)


def _backup_save(cell, directory):
    _backup_loop(cell, directory, STOP)


def _backup_resume(cell, directory):
    _backup_loop(cell, directory, None)


def _preemption_loop(cell, directory, notice_after):
    handler = ts.PreemptionCheckpointHandler(
        cell.strategy.cluster_resolver, {"model": cell.model, "optimizer": cell.optimizer},
        os.path.join(directory, "preemption"), ts.TerminationConfig(exit_fn=_exit))
    with handler.watch_preemption_scope():
        try:
            cell.data.set_epoch(0, handler.total_run_calls)
            for batch in cell.data:
                handler.run(cell.step, batch)
                if handler.total_run_calls == notice_after and dist.get_rank() == 0:
                    # The notice after step STOP - 1: the replicas agree to save after the
                    # next step, STOP (PreemptionCheckpointHandler's protocol).
                    os.kill(os.getpid(), signal.SIGTERM)
        except _Preempted:  # the exit_fn, after the save (the restart's stand-in)
            assert handler.total_run_calls == STOP, handler.total_run_calls
            return
    assert notice_after is None and handler.restored and handler.total_run_calls == STEPS


def _preemption_save(cell, directory):
    _preemption_loop(cell, directory, STOP - 1)


def _preemption_resume(cell, directory):
    _preemption_loop(cell, directory, None)


SAVE = {"checkpoint": _checkpoint_save, "backup": _backup_save,
        "preemption": _preemption_save}
RESUME = {"checkpoint": _checkpoint_resume, "backup": _backup_resume,
          "preemption": _preemption_resume}


def _cell_directory(root, strategy_name, path):
    directory = os.path.join(root, f"{strategy_name}-{path}")
    if dist.get_rank() == 0:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    dist.barrier()
    return directory


def save_all(root, cells):
    """First launch: every cell trains STOP steps and saves through its path; returns
    {cell: what the save path reported} (ts.checkpoint: the refusal of a sharded
    state_dict)."""
    return {(strategy_name, path): SAVE[path](Cell(strategy_name, seed=0),
                                              _cell_directory(root, strategy_name, path))
            for strategy_name, path in cells}


def resume_all(root, cells):
    """Later launch: every cell, from wrong weights, resumes from its checkpoint and
    finishes; {cell: (weights, Adam state) or the error's text} on replica 0."""
    out = {}
    for strategy_name, path in cells:
        cell = Cell(strategy_name, seed=1)
        try:
            RESUME[path](cell, os.path.join(root, f"{strategy_name}-{path}"))
            out[(strategy_name, path)] = cell.result()
        except Exception as error:  # reported per cell; the other cells still run
            out[(strategy_name, path)] = f"{type(error).__name__}: {error}"
    return out
