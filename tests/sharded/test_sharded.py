"""ShardedStrategy (FSDP2) with real processes on gloo.

Two launches check everything (4 replicas, then 2):
- training equals one device (Adam, to 1e-5) for an MLP and a small transformer, the
  optimizer built in the same scope as the model (before it was sharded); at 4 replicas
  also with hybrid sharding over a 2x2 mesh, at 2 with reshard_after_forward=False + CPU
  offload, and with bf16 mixed precision (float32 shards and gradients, close losses);
  gradient accumulation under extended.no_sync() gives the whole batch's gradient;
- the bytes of parameters + gradients + Adam state a replica holds (its local shards) are
  <= 0.3 (4 replicas) / 0.55 (2 replicas) of what MirroredStrategy holds (everything);
- a checkpoint saved by 4 replicas loads on 2; the export is a plain state_dict that loads
  into the unwrapped model;
- ts.BackupAndRestore (2 replicas): a backup written mid-epoch restores into a fresh
  sharded model and Adam exactly (weights and optimizer state), and training on from it
  gives exactly the losses and weights of the run that did not stop;
- a module created outside the scope and a shard_modules entry naming no module give clear
  errors.
"""
import copy
import os
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import torchstrategy as ts
from tests.helpers.replicas import assert_same_tensors, launch

pytestmark = pytest.mark.timeout(240)

SEED = 7
STEPS = 3
GLOBAL_BATCH = 8
ATOL = 1e-5


def make_mlp():
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=32, width=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        # No biases: the key projection's bias has a gradient of rounding noise only
        # (softmax ignores it), which Adam would amplify differently on each layout.
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=64, dropout=0.0,
                                           batch_first=True, bias=False)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def data(kind):
    g = torch.Generator().manual_seed(SEED)
    if kind == "mlp":
        return [(torch.randn(GLOBAL_BATCH, 12, generator=g),
                 torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)) for _ in range(STEPS)]
    return [(torch.randint(0, 32, (GLOBAL_BATCH, 6), generator=g),
             torch.randint(0, 32, (GLOBAL_BATCH, 6), generator=g)) for _ in range(STEPS)]


def build(kind):
    torch.manual_seed(SEED)
    return make_mlp() if kind == "mlp" else TinyTransformer()


def per_example_loss(model, x, y):
    out = model(x)
    if out.dim() == 3:
        return F.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1)
    return F.cross_entropy(out, y, reduction="none")


def single_device(kind):
    """Parameters and losses of one device training on the global batches."""
    model = build(kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in data(kind):
        loss = per_example_loss(model, x, y).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def sharded_training(strategy, kind):
    with strategy.scope():
        model = build(kind)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(x, y):
        loss = ts.compute_average_loss(per_example_loss(model, x, y),
                                       global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = []
    for x, y in strategy.experimental_distribute_dataset(data(kind)):
        loss = strategy.run(step, args=(x, y))
        losses.append(strategy.reduce("SUM", loss, axis=None).item())
    return model, optimizer, losses


def local_bytes(tensor):
    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def training_state_bytes(model, optimizer):
    """Parameters + gradients + Adam moments this replica holds (local shards).
    Gradients are counted as the parameters (they are freed by zero_grad)."""
    total = 0
    for p in model.parameters():
        total += 2 * local_bytes(p)
        state = optimizer.state[p]
        total += local_bytes(state["exp_avg"]) + local_bytes(state["exp_avg_sq"])
    return total


def check_equal_to_one_device(strategy, kind, atol=ATOL):
    """Trains; returns (model, optimizer, export) after checking the export and the losses
    against one device on every replica's export (the chief's is the full one)."""
    reference, reference_losses = single_device(kind)
    model, optimizer, losses = sharded_training(strategy, kind)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert strategy.extended.variable_created_in_scope(next(model.parameters()))
    assert optimizer.param_groups[0]["params"][0] is next(model.parameters())
    exported = strategy.extended.export_state_dict(model)
    if strategy.extended.should_checkpoint:
        assert list(exported) == list(reference)
        plain = build(kind)
        plain.load_state_dict(exported)  # strict: no prefixes, plain tensors
        for key, value in exported.items():
            assert type(value) is torch.Tensor, key
            torch.testing.assert_close(value, reference[key], atol=atol, rtol=0,
                                       msg=lambda m: f"{kind} {strategy!r} {key}: {m}")
    else:
        assert exported == {}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses),
                               atol=atol, rtol=0)
    return model, optimizer, exported


def build_in_scope(strategy, kind):
    with strategy.scope():
        model = build(kind)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def train_with_backup(strategy, backup, model, optimizer):
    """Trains the rest of one epoch under `backup` (save_freq=2); returns the exported
    model and full optimizer state after step 1 (what the backup holds) and the losses."""
    def step(x, y):
        loss = ts.compute_average_loss(per_example_loss(model, x, y),
                                       global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    at_backup, losses = None, []
    dataset = strategy.experimental_distribute_dataset(data("transformer"))
    for _ in backup.epochs(1):
        for index, (x, y) in backup.steps(dataset):
            loss = strategy.run(step, args=(x, y))
            losses.append(strategy.reduce("SUM", loss, axis=None).item())
            if index == 1:  # written right after this step's body
                # A copy: like optimizer.state_dict(), the state holds the live `step`.
                at_backup = copy.deepcopy(
                    (strategy.extended.export_state_dict(model),
                     strategy.extended.state_dict_for_checkpoint(optimizer)))
    return at_backup, losses


def as_lists(groups):
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def backup_and_restore_round_trip(strategy, directory):
    """ts.BackupAndRestore with sharded models: every replica saves (the chief writes the
    full tensors); a fresh sharded model and optimizer tracking the same directory get the
    saved weights and Adam state exactly, and training on from there gives exactly the
    losses and weights of the run that did not stop."""
    model, optimizer = build_in_scope(strategy, "transformer")
    first = ts.BackupAndRestore(directory, save_freq=2, delete_checkpoint=False)
    first.track(model=model, optimizer=optimizer)
    assert not first.restored
    (saved_model, saved_optimizer), losses = train_with_backup(strategy, first, model,
                                                                optimizer)
    assert len(losses) == STEPS
    final = strategy.extended.export_state_dict(model)

    # The same processes start over: a fresh sharded model and optimizer, restored.
    restored, restored_optimizer = build_in_scope(strategy, "transformer")
    second = ts.BackupAndRestore(directory, save_freq=2)
    second.track(model=restored, optimizer=restored_optimizer)
    assert second.restored and (second.epoch, second.step, second.global_step) == (0, 2, 2)
    assert all(isinstance(p, DTensor) for p in restored.parameters())
    weights = strategy.extended.export_state_dict(restored)
    moments = strategy.extended.state_dict_for_checkpoint(restored_optimizer)
    chief = strategy.extended.should_checkpoint
    if chief:
        assert_same_tensors(weights, saved_model, what="restored weights")
        assert list(moments["state"]) == list(saved_optimizer["state"])
        for name, value in saved_optimizer["state"].items():
            assert_same_tensors(moments["state"][name], value, what=f"Adam state of {name}")
        # (torch's set_optimizer_state_dict gives tuples, Adam's betas, back as lists)
        assert as_lists(moments["param_groups"]) == as_lists(saved_optimizer["param_groups"])
    else:
        assert weights == {} and moments == {}
    # An optimizer over plain parameters is stored as it is, even beside sharded models.
    plain = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    assert strategy.extended.state_dict_for_checkpoint(plain) == plain.state_dict()

    # Training on from the backup: the last step exactly as in the run that did not stop.
    _, resumed = train_with_backup(strategy, second, restored, restored_optimizer)
    assert resumed == losses[2:], (resumed, losses)
    again = strategy.extended.export_state_dict(restored)
    if chief:
        assert_same_tensors(again, final, what="weights after training on")
    assert not os.path.exists(second.path)  # delete_checkpoint=True at the end


def four_replicas(path):
    strategy = ts.ShardedStrategy()
    check_equal_to_one_device(strategy, "mlp")
    model, optimizer, exported = check_equal_to_one_device(strategy, "transformer")
    reference, _ = single_device("transformer")
    mirrored_bytes = 4 * sum(v.numel() * v.element_size() for v in reference.values())
    ratio = training_state_bytes(model, optimizer) / mirrored_bytes
    assert ratio <= 0.3, ratio
    strategy.extended.save_checkpoint(path, model, optimizer)
    saved = strategy.extended.state_dict_for_checkpoint(optimizer)

    hybrid = ts.ShardedStrategy(shard_group_size=2)
    model, _, _ = check_equal_to_one_device(hybrid, "mlp")
    placements = next(model.parameters()).placements
    assert [type(p).__name__ for p in placements] == ["Replicate", "Shard"], placements
    return ratio, pickle.dumps((exported, saved))


def two_replicas(path, saved, backup_dir):
    strategy = ts.ShardedStrategy()
    check_equal_to_one_device(strategy, "mlp")
    model, optimizer, _ = check_equal_to_one_device(strategy, "transformer")
    reference, _ = single_device("transformer")
    mirrored_bytes = 4 * sum(v.numel() * v.element_size() for v in reference.values())
    ratio = training_state_bytes(model, optimizer) / mirrored_bytes
    assert ratio <= 0.55, ratio

    # Saved by 4 replicas, loaded by 2: the same model and optimizer state.
    with strategy.scope():
        loaded = build("transformer")
        loaded_optimizer = torch.optim.Adam(loaded.parameters(), lr=1e-2)
    strategy.extended.load_checkpoint(path, loaded, loaded_optimizer)
    again = strategy.extended.export_state_dict(loaded)
    optimizer_state = strategy.extended.state_dict_for_checkpoint(loaded_optimizer)
    if strategy.extended.should_checkpoint:
        saved_model, saved_optimizer = pickle.loads(saved)
        assert list(again) == list(saved_model)
        for key in again:
            torch.testing.assert_close(again[key], saved_model[key], atol=0, rtol=0)
        for name, moments in saved_optimizer["state"].items():
            for key, value in moments.items():
                torch.testing.assert_close(optimizer_state["state"][name][key], value,
                                           atol=0, rtol=0)

    backup_and_restore_round_trip(strategy, backup_dir)

    # no_sync: two half batches, the first without communication, give the gradient of
    # the whole batch.
    with strategy.scope():
        accumulating = build("mlp")
    reference_model = build("mlp")
    x, y = data("mlp")[0]
    per_example_loss(reference_model, x, y).mean().backward()
    rank = strategy.extended.replica_id
    mine = (x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])

    def half(x, y):
        ts.compute_average_loss(per_example_loss(accumulating, x, y),
                                global_batch_size=GLOBAL_BATCH).backward()
    with strategy.extended.no_sync():
        strategy.run(half, args=(mine[0][:2], mine[1][:2]))
    strategy.run(half, args=(mine[0][2:], mine[1][2:]))
    for p, q in zip(accumulating.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=ATOL, rtol=0)

    # The one moment a model is sharded: when the outermost scope exits (not while it is
    # open, not at a nested scope's exit); what the handling adds is on `extended`.
    with strategy.scope():
        with strategy.scope():
            pending = build("mlp")
        assert not any(isinstance(p, DTensor) for p in pending.parameters())
    assert all(isinstance(p, DTensor) for p in pending.parameters())
    assert strategy.extended.mesh is strategy.extended.parameters.mesh

    # Options: keep gathered parameters between forward and backward, offload to host.
    check_equal_to_one_device(
        ts.ShardedStrategy(reshard_after_forward=False, cpu_offload=True,
                           shard_modules=[nn.Linear]), "mlp")
    # bf16 compute, float32 shards and reduction: close to one device, not equal.
    low = ts.ShardedStrategy(mixed_precision="bf16")
    model, _, losses = sharded_training(low, "mlp")
    _, reference_losses = single_device("mlp")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses),
                               atol=3e-2, rtol=0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    errors = {}
    try:
        with ts.ShardedStrategy(shard_modules=["Linear", "no_such_block"]).scope():
            kept = make_mlp()  # noqa: F841 (a model alive at scope exit is sharded)
    except ValueError as error:
        errors["shard_modules"] = str(error)
    outside = make_mlp()
    unscoped = ts.ShardedStrategy()
    with unscoped.scope():
        inside = make_mlp()  # noqa: F841
    try:
        unscoped.run(lambda x: outside(x).sum().backward(), args=(torch.randn(2, 12),))
    except RuntimeError as error:
        errors["outside"] = str(error)
    return ratio, errors


def test_sharded_training_checkpoints_and_errors(tmp_path):
    path = str(tmp_path / "checkpoint")
    ratio_4, saved = launch(four_replicas, path, n=4)
    backup_dir = tmp_path / "backup"
    backup_dir.mkdir(mode=0o700)
    backup_dir.chmod(0o700)  # BackupAndRestore refuses a directory others can write
    ratio_2, errors = launch(two_replicas, path, saved, str(backup_dir), n=2)
    assert ratio_4 <= 0.3 and ratio_2 <= 0.55
    assert "['no_such_block'] name no module" in errors["shard_modules"]
    assert "Linear" in errors["shard_modules"]  # the classes there are listed
    assert "called a Linear that holds parameters but was not created in ShardedStrategy's " \
           "scope()" in errors["outside"]
    assert "strategy.adopt(model, optimizer)" in errors["outside"]


def test_bad_options_are_refused_before_launching():
    with pytest.raises(ValueError, match=r"mixed_precision='int8'"):
        ts.ShardedStrategy(mixed_precision="int8")
    with pytest.raises(TypeError, match=r"cpu_offload='yes'"):
        ts.ShardedStrategy(cpu_offload="yes")
    with pytest.raises(ValueError, match=r"reshard_after_forward=1"):
        ts.ShardedStrategy(reshard_after_forward=1)
    with pytest.raises(TypeError, match=r"entry 3 is neither"):
        ts.ShardedStrategy(shard_modules=[nn.Linear, 3])
    with pytest.raises(ValueError, match=r"shard_group_size=0"):
        ts.ShardedStrategy(shard_group_size=0)
