"""What an FSDP2 user expects from ShardedStrategy, on real replicas (gloo), each result
compared with one device training on the same global batches.

Two launches check everything:
- 2 replicas: ``activation_checkpointing=True`` gives exactly the gradients of the run
  without it (atol 0) and trains equal to one device (Adam, 1e-5), while the forward keeps
  only each block's input for backward inside the blocks (counted with
  ``saved_tensors_hooks``: one tensor per block instead of all its activations; the same
  count outside the blocks); ``model.compile()``
  (inductor) of the sharded model trains equal to eager (and to one device) to 1e-5;
  ``ts.clip_grad_norm_`` returns a plain tensor equal to one device's norm (rtol 1e-6) and
  clips every shard as one device does, where torch's own returns a DTensor;
  ``ts.accumulate`` over two micro-batches in an FSDP2-style loop outside ``run``
  (``micro.scale_mean_loss`` of each replica's mean loss) gives one device's whole-batch
  gradient (1e-6); a ``MixedPrecisionPolicy`` reaches ``fully_shard`` as given;
  ``activation_checkpointing=True`` on a model with no unit to
  checkpoint is refused (a
  model without units built beside one with units is not).
- In one process: a checkpointed block with dropout recomputes the forward's mask in
  backward (random numbers drawn in between do not leak in) and gets keyword arguments:
  gradients equal bit for bit; ``ts.clip_grad_norm_`` of plain parameters is torch's.
- docs/sharded.md's "Porting from FSDP2" diff, applied to the FSDP2 example of
  tests/porting/programs/, gives the port that tests/porting/test_real_programs.py runs
  against it (the same code; the module docstrings aside).
- 4 replicas in 2 groups of 2 (``shard_group_size=2``, hybrid sharding on a 2x2 mesh):
  training with gradient clipping every step equals one device (1e-5), and the norms are
  one device's.
"""
import ast
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

import torchstrategy as ts
from torchstrategy.strategies.sharding.training import checkpoint_activations
from tests.helpers import ROOT
from tests.helpers.replicas import launch
from tests.porting.programs.harness import PROGRAMS, apply_diff, guide_diffs

pytestmark = pytest.mark.timeout(240)

SEED = 3
STEPS = 3
GLOBAL_BATCH = 8
VOCAB, WIDTH, LAYERS, SEQ = 32, 16, 3, 6
ATOL = 1e-5
MAX_NORM = 0.5  # below the first steps' norms: clipping changes the update


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build():
    torch.manual_seed(SEED)
    return Net()


def batches():
    g = torch.Generator().manual_seed(SEED)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def per_example_loss(model, x, y):
    return F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(1)


def one_device(clip=False):
    """Weights, losses, per-step gradient norms and first-step gradients of one device."""
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, norms, first_grads = [], [], None
    for x, y in batches():
        loss = per_example_loss(model, x, y).mean()
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        if first_grads is None:
            first_grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses, norms, first_grads


class SavedTensors:
    """Counts the tensors a forward saves for backward, inside the model's blocks (between
    a block's forward pre-hook and its forward hook) and outside them."""

    def __init__(self, model):
        self.depth = 0
        self.inside = self.outside = 0
        for block in model.blocks:
            block.register_forward_pre_hook(self.enter)
            # Before FSDP2's own forward hook (the reshard is not the block's forward).
            block.register_forward_hook(self.leave, prepend=True)

    def enter(self, module, args):
        self.depth += 1

    def leave(self, module, args, output):
        self.depth -= 1

    def pack(self, tensor):
        if self.depth:
            self.inside += 1
        else:
            self.outside += 1
        return tensor

    def counting(self):
        self.inside = self.outside = 0
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def train(strategy, model, clip=False, count_saved=False):
    """Trains `model` (built in `strategy`'s scope) with Adam; returns losses, norms, the
    first step's full gradients and, with `count_saved`, how many tensors each forward
    saved for backward inside and outside the blocks on this replica."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = {"losses": [], "norms": [], "saved": [], "grads": None}
    saved = SavedTensors(model) if count_saved else None

    def step(x, y):
        if saved is None:
            per_example = per_example_loss(model, x, y)
        else:
            with saved.counting():
                per_example = per_example_loss(model, x, y)
            out["saved"].append((saved.inside, saved.outside))
        loss = ts.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        if clip:
            norm = ts.clip_grad_norm_(model.parameters(), MAX_NORM)
            assert type(norm) is torch.Tensor and norm.dim() == 0, type(norm)
            out["norms"].append(norm.item())
        if out["grads"] is None:
            out["grads"] = [p.grad.full_tensor() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for x, y in strategy.experimental_distribute_dataset(batches()):
        loss = strategy.run(step, args=(x, y))
        out["losses"].append(strategy.reduce("SUM", loss, axis=None).item())
    out["state"] = strategy.extended.export_state_dict(model)
    return out


def assert_close_to(run, reference, atol=ATOL, what=""):
    state, losses, norms, _ = reference
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), atol=atol,
                               rtol=0, msg=lambda m: f"{what} losses: {m}")
    if norms:
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(norms),
                                   atol=0, rtol=1e-6, msg=lambda m: f"{what} norms: {m}")
    if run["state"]:  # the chief's export
        for key, value in state.items():
            torch.testing.assert_close(run["state"][key], value, atol=atol, rtol=0,
                                       msg=lambda m: f"{what} {key}: {m}")


def build_in(strategy):
    with strategy.scope():
        return build()


def two_replicas():
    reference = one_device()
    results = {}

    # Activation checkpointing: same gradients, fewer saved tensors.
    plain = ts.ShardedStrategy()
    results["plain"] = train(plain, build_in(plain), count_saved=True)
    checkpointed = ts.ShardedStrategy(activation_checkpointing=True)
    model = build_in(checkpointed)
    assert all("forward" in vars(block) for block in model.blocks)
    assert "forward" not in vars(model)  # the model itself is not checkpointed
    results["checkpointed"] = train(checkpointed, model, count_saved=True)
    for name in ("plain", "checkpointed"):
        assert_close_to(results[name], reference, what=name)
    for p, q in zip(results["checkpointed"]["grads"], results["plain"]["grads"]):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
    # Inside the blocks: many tensors kept without checkpointing, with it only each
    # block's input (one tensor per block); outside (embedding, head, loss): the same.
    saved_plain, saved_checkpointed = results["plain"]["saved"], results["checkpointed"]["saved"]
    assert all(inside >= 4 * LAYERS for inside, _ in saved_plain), saved_plain
    assert [inside for inside, _ in saved_checkpointed] == [LAYERS] * STEPS, saved_checkpointed
    assert [outside for _, outside in saved_checkpointed] == \
        [outside for _, outside in saved_plain], (saved_checkpointed, saved_plain)
    # A deep copy's checkpointed forward runs the copy, not the original.
    twin = nn.Linear(2, 2)
    checkpoint_activations(twin)
    copied = copy.deepcopy(twin)
    assert copied.forward.__self__ is copied

    # torch.compile of the sharded model (in place, the form torch recommends with hooks).
    compiled_strategy = ts.ShardedStrategy()
    compiled = build_in(compiled_strategy)
    compiled.compile()
    results["compiled"] = train(compiled_strategy, compiled)
    assert_close_to(results["compiled"], reference, what="compiled")
    torch.testing.assert_close(torch.tensor(results["compiled"]["losses"]),
                               torch.tensor(results["plain"]["losses"]), atol=ATOL, rtol=0)

    # Clipping: a plain norm, one device's; torch's own returns a DTensor.
    clipped = ts.ShardedStrategy()
    results["clipped"] = train(clipped, build_in(clipped), clip=True)
    assert_close_to(results["clipped"], one_device(clip=True), what="clipped")
    probe = build_in(clipped)
    x, y = batches()[0]
    rank = clipped.extended.replica_id
    clipped.run(lambda: ts.compute_average_loss(
        per_example_loss(probe, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]),
        global_batch_size=GLOBAL_BATCH).backward())
    torch_norm = torch.nn.utils.clip_grad_norm_(probe.parameters(), float("inf"))
    results["torch_norm_type"] = type(torch_norm).__name__
    results["torch_norm_placements"] = [type(p).__name__ for p in torch_norm.placements]
    # What a user logging torch's norm meets, and ours avoids.
    with pytest.raises(TypeError):
        f"{torch_norm:.3f}"
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch_norm + torch.zeros(2)
    ours = ts.clip_grad_norm_(probe.parameters(), float("inf"))
    assert f"{ours:.6f}" == f"{torch_norm.item():.6f}"
    assert torch.equal(ours + torch.zeros(2), torch.full((2,), torch_norm.item()))

    # ts.accumulate in an FSDP2-style loop (outside run, each replica its half of the
    # batch, FSDP2's mean loss): two micro-batches give one device's whole-batch gradient.
    accumulating = ts.ShardedStrategy()
    accumulated = build_in(accumulating)
    x, y = batches()[0]
    rank = accumulating.extended.replica_id
    mine = [(x[rank * 4 + i:rank * 4 + i + 2], y[rank * 4 + i:rank * 4 + i + 2]) for i in (0, 2)]
    for micro in ts.accumulate(accumulating, mine, steps=2):
        with micro:
            micro.scale_mean_loss(per_example_loss(accumulated, *micro.batch).mean()).backward()
    for p, q in zip(accumulated.parameters(), reference[3]):
        torch.testing.assert_close(p.grad.full_tensor(), q, atol=1e-6, rtol=0)

    # FSDP2's MixedPrecisionPolicy passes straight through to every fully_shard call.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert ts.ShardedStrategy(mixed_precision=policy).extended.fsdp_kwargs["mp_policy"] is policy

    # Models sharded together need one unit between them: a lone head beside them is fine.
    together = ts.ShardedStrategy(activation_checkpointing=True)
    with together.scope():
        net, head = build(), nn.Linear(VOCAB, 2)
    assert all("forward" in vars(block) for block in net.blocks)
    assert "forward" not in vars(head) and "forward" not in vars(net)

    errors = {}
    try:
        with ts.ShardedStrategy(activation_checkpointing=True).scope():
            lone = nn.Linear(3, 3)  # noqa: F841 (alive at scope exit: sharded)
    except ValueError as error:
        errors["no_units"] = str(error)
    try:
        checkpoint_activations(model.blocks[0])
    except ValueError as error:
        errors["twice"] = str(error)
    return {"saved": (saved_plain, saved_checkpointed),
            "torch_norm": (results["torch_norm_type"], results["torch_norm_placements"]),
            "errors": errors}


def four_replicas_hybrid():
    strategy = ts.ShardedStrategy(shard_group_size=2)
    model = build_in(strategy)
    placements = [type(p).__name__ for p in next(model.parameters()).placements]
    assert placements == ["Replicate", "Shard"], placements
    assert strategy.extended.mesh.shape == (2, 2)
    run = train(strategy, model, clip=True)
    assert_close_to(run, one_device(clip=True), what="hybrid")
    return run["norms"]


def test_checkpointing_compile_and_clip_on_two_replicas():
    result = launch(two_replicas, n=2)
    saved_plain, saved_checkpointed = result["saved"]
    assert saved_checkpointed[0][0] == LAYERS < saved_plain[0][0]
    # What torch 2.13 gives, the reason for ts.clip_grad_norm_: a replicated DTensor.
    assert result["torch_norm"] == ("DTensor", ["Replicate"])
    assert "Net" not in result["errors"]["no_units"]
    assert "Linear has no unit but the model itself to checkpoint" in \
        result["errors"]["no_units"]
    assert "shard_modules=[...]" in result["errors"]["no_units"]
    assert "already has a forward of its own" in result["errors"]["twice"]


def test_hybrid_sharding_with_clipping_equals_one_device():
    norms = launch(four_replicas_hybrid, n=4)
    assert len(norms) == STEPS and norms[0] > MAX_NORM  # clipping did change the update


def test_clip_grad_norm_of_plain_parameters_is_torchs():
    a, b = build(), build()
    x, y = batches()[0]
    for model in (a, b):
        per_example_loss(model, x, y).mean().backward()
    ours = ts.clip_grad_norm_(a.parameters(), MAX_NORM)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), MAX_NORM)
    assert type(ours) is torch.Tensor and ours.item() > MAX_NORM
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0)


def test_bad_activation_checkpointing_is_refused_before_launching():
    with pytest.raises(TypeError, match=r"activation_checkpointing='yes'\): give True or False"):
        ts.ShardedStrategy(activation_checkpointing="yes")


def code_without_docstring(text):
    module = ast.parse(text)
    if module.body and isinstance(module.body[0], ast.Expr) and \
            isinstance(module.body[0].value, ast.Constant):
        module.body = module.body[1:]
    return ast.dump(module)


def test_porting_diff_of_the_docs_gives_the_tested_fsdp2_port():
    with open(f"{ROOT}/docs/sharded.md", encoding="utf-8") as f:
        diffs = guide_diffs(f.read())
    assert [d.name for d in diffs] == ["fsdp2_example.py"]
    original = (PROGRAMS / "fsdp2_example.py").read_text()
    ported = apply_diff(original, diffs[0])
    assert "fully_shard(" not in ported and "init_process_group(" not in ported
    assert code_without_docstring(ported) == \
        code_without_docstring((PROGRAMS / "fsdp2_example_ported.py").read_text())


class DropoutBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x, scale=1.0):
        return x + scale * self.down(self.drop(F.gelu(self.up(x))))


def test_checkpointed_dropout_recomputes_the_same_mask_and_gradients():
    """Backward's recomputation sees the forward's random numbers (dropout's mask), and
    keyword arguments reach the checkpointed forward: gradients equal, bit for bit."""
    torch.manual_seed(SEED)
    plain = DropoutBlock()
    checkpointed = copy.deepcopy(plain)
    checkpoint_activations(checkpointed)
    x = torch.randn(4, SEQ, WIDTH)
    grads = []
    for block in (plain, checkpointed):
        torch.manual_seed(SEED + 1)
        out = block(x, scale=0.5)
        torch.rand(8)  # draws between forward and backward: the recomputation must not see them
        out.square().sum().backward()
        grads.append([p.grad for p in block.parameters()])
    assert grads[0][0].abs().sum() > 0
    for p, q in zip(*grads):
        torch.testing.assert_close(p, q, atol=0, rtol=0)
