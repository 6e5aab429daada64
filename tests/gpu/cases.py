"""What the tests of tests/gpu run in their own processes, on a device given by name ("cuda",
or "cpu" where the same logic is checked without a GPU), returning what the tests compare.

Each function is started by a test in a fresh process (``python -m tests.gpu.cases NAME
ARGS...``, or ``ts.launch``), so that every strategy gets a process of its own and a CUDA
failure cannot take the test runner with it. No test here; see test_strategies_cuda.py.
"""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchstrategy as ts
from torchstrategy.strategies.sharding import plan

SEED = 5
STEPS = 4
GLOBAL_BATCH = 8
D_IN, D_HIDDEN, D_OUT = 12, 32, 3
OVERFLOW_STEP = 2       # the fp16 step whose gradient overflows on one replica


def deterministic(device):
    """The settings under which one device repeats itself bit for bit (an op without a
    deterministic kernel warns instead of failing: both sides of a comparison run it)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


class ConvNet(nn.Module):
    """A convolution, a BatchNorm-free MLP head: parameters of several shapes and sizes."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * D_IN, D_HIDDEN)
        self.fc2 = nn.Linear(D_HIDDEN, D_OUT)

    def forward(self, x):
        x = F.relu(self.conv(x.unsqueeze(1))).flatten(1)
        return self.fc2(torch.tanh(self.fc1(x)))


def batches(steps=STEPS, overflow_row=None):
    """`steps` global batches (inputs, targets) of GLOBAL_BATCH rows, shuffled; with
    `overflow_row`, batch OVERFLOW_STEP holds an infinity in that row."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(steps * GLOBAL_BATCH, D_IN, generator=g)
    y = torch.randn(steps * GLOBAL_BATCH, D_OUT, generator=g)
    order = torch.randperm(steps * GLOBAL_BATCH, generator=g)
    out = [(x[i], y[i]) for i in order.split(GLOBAL_BATCH)]
    if overflow_row is not None:
        out[OVERFLOW_STEP][0][overflow_row, 0] = float("inf")
    return out


def summed_loss(model, x, y):
    """This replica's share of the global mean: summed over its rows, divided by the global
    batch (summed over replicas it is the mean)."""
    return F.mse_loss(model(x).float(), y, reduction="sum") / (GLOBAL_BATCH * D_OUT)


def cpu_state(module):
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


# -- MirroredStrategy() with no arguments, world 1, against a plain loop -------------------
def world_one():
    """Trains ConvNet STEPS steps under ``MirroredStrategy()`` (no arguments), then the same
    steps in a plain loop from the same initial values; returns the strategy's facts and
    both final states."""
    strategy = ts.MirroredStrategy()
    device = strategy.extended.torch_device
    deterministic(device)
    torch.manual_seed(SEED)
    with strategy.scope():
        model = ConvNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    facts = {"device": str(device), "parameter_devices": sorted({str(p.device) for p in
                                                                 model.parameters()}),
             "backend": dist.get_backend() if dist.is_initialized() else None,
             "replicas": strategy.num_replicas_in_sync, "repr": repr(strategy)}

    def step(x, y):
        summed_loss(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for x, y in batches():
        strategy.run(step, args=(x.to(device), y.to(device)))
    plain = ConvNet().to(device)
    plain.load_state_dict(initial)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches():
        summed_loss(plain, x.to(device), y.to(device)).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    return {"facts": facts, "ours": cpu_state(model), "plain": cpu_state(plain)}


# -- two processes sharing one device over gloo ---------------------------------------------
def _one_device(initial, data, device, precision=None, scaler_device=None):
    """The reference: one process, the whole global batch, the same optimiser."""
    model = ConvNet().to(device)
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(scaler_device, init_scale=2.0 ** 10) if scaler_device \
        else None
    for x, y in data:
        with torch.autocast(device.type, dtype=precision, enabled=precision is not None):
            loss = summed_loss(model, x.to(device), y.to(device))
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
    return cpu_state(model)


def _train_shared(strategy, device, data, precision=None, use_scaler=False,
                  side_stream=False):
    """Trains a ConvNet built in scope on this replica's rows of `data`; returns the
    initial state, the final state, and per step (scale before, scale after, whether the
    parameters changed)."""
    rank, n = strategy.extended.replica_id, strategy.num_replicas_in_sync
    torch.manual_seed(SEED + rank)          # a different init per replica, until the
    with strategy.scope():                  # scope broadcasts replica 0's
        model = ConvNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10) if use_scaler else None
    trace = []

    def forward_backward(x, y):
        with torch.autocast(device.type, dtype=precision, enabled=precision is not None):
            loss = summed_loss(model, x, y)
        (scaler.scale(loss) if scaler else loss).backward()

    def step(x, y):
        if side_stream and device.type == "cuda":
            # The gradients are produced on a side stream that is kept busy first: a
            # reducer reading them on another stream without waiting reads stale values.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)
                forward_backward(x, y)
            torch.cuda.current_stream(device).wait_stream(side)
        else:
            forward_backward(x, y)
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale() if scaler else None
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        trace.append((scale, scaler.get_scale() if scaler else None, changed))

    for x, y in data:
        rows = torch.tensor_split(torch.arange(GLOBAL_BATCH), n)[rank]
        strategy.run(step, args=(x[rows].to(device), y[rows].to(device)))
    return {k: v.cpu() for k, v in initial.items()}, cpu_state(model), trace


def shared_device(rank, init_file, out):
    """One of two processes on one device, over a gloo group made beforehand (as Ray Train
    or a user makes it) and adopted by ``MirroredStrategy()``: CUDA tensors over gloo when
    the device is a GPU. Trains fp32 (gradients produced on a busy side stream), bf16
    autocast, and fp16 with a GradScaler whose step OVERFLOW_STEP overflows on replica 1
    only; rank 0 also trains the one-device references. Saves the results to `out`."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=90))
    strategy = ts.MirroredStrategy()
    device = strategy.extended.torch_device
    fp16_data = batches(overflow_row=GLOBAL_BATCH - 1)   # a row of replica 1
    result = {"device": str(device), "backend": dist.get_backend(),
              "replicas": strategy.num_replicas_in_sync}
    runs = {"fp32": dict(data=batches(), side_stream=True),
            "bf16": dict(data=batches(), precision=torch.bfloat16),
            "fp16": dict(data=fp16_data, precision=torch.float16, use_scaler=True)}
    for name, options in runs.items():
        initial, final, trace = _train_shared(strategy, device, **options)
        result[name] = {"final": final, "trace": trace}
        if rank == 0:
            result[name]["one_device"] = _one_device(
                initial, options["data"], device, options.get("precision"),
                device.type if options.get("use_scaler") else None)
    torch.save(result, out)
    dist.destroy_process_group()


# -- compression: NCCL against gloo ---------------------------------------------------------
def compression_of(kind):
    """"bf16", "int8", "powersgd"; "-overlap" after either of the last two compresses each
    bucket during backward (on a GPU, on the stage's side stream)."""
    overlap = kind.endswith("-overlap")
    return {"bf16": "bf16", "int8": ts.Int8(chunk_size=64, overlap=overlap),
            "powersgd": ts.PowerSGD(rank=2, warmup_steps=1, seed=3, overlap=overlap),
            }[kind.removesuffix("-overlap")]


def compressed_training(kind, backend):
    """Under ts.launch: trains ConvNet with `kind` compression, over NCCL (``MirroredStrategy``
    on GPUs; gloo on CPUs, where NCCL does not exist) or over gloo (RING) with the same
    devices; returns the applied gradients of each step and the final state."""
    compression = compression_of(kind)
    if backend == "ring":
        strategy = ts.MultiWorkerMirroredStrategy(
            communication_options=ts.CommunicationOptions(implementation="RING",
                                                          compression=compression))
    else:
        strategy = ts.MirroredStrategy(
            cross_device_ops=ts.NcclAllReduce(compression=compression))
    device = strategy.extended.torch_device
    deterministic(device)
    rank, n = strategy.extended.replica_id, strategy.num_replicas_in_sync
    torch.manual_seed(SEED)
    with strategy.scope():
        model = ConvNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    applied = []

    def step(x, y):
        summed_loss(model, x, y).backward()
        applied.append([p.grad.detach().float().cpu().clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()

    for x, y in batches():
        rows = torch.tensor_split(torch.arange(GLOBAL_BATCH), n)[rank]
        strategy.run(step, args=(x[rows].to(device), y[rows].to(device)))
    return {"backend": dist.get_backend(), "device": str(device), "replicas": n,
            "applied": applied, "final": cpu_state(model)}


# -- ShardedStrategy in bf16 against a hand-written FSDP2 loop ------------------------------
VOCAB, WIDTH, LAYERS, SEQ = 64, 32, 2, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Repeated blocks (the units), an embedding and a head of the model's own."""

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


def token_batches(steps=STEPS):
    g = torch.Generator().manual_seed(SEED)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(steps)]


def token_loss(model, tokens, targets):
    return F.cross_entropy(model(tokens).float().reshape(-1, VOCAB), targets.reshape(-1),
                           reduction="sum") / (GLOBAL_BATCH * SEQ)


def full_state(model):
    """The whole state of a model sharded by hand (world 1: the shards are the whole)."""
    from torch.distributed.tensor import DTensor   # the DTensor API, for FSDP2 only
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu()
            .clone() for k, v in model.state_dict().items()}


def exported(strategy, model):
    """A copy of the full state ShardedStrategy exports (on one replica, on the CPU, the
    export may share storage with the live parameters)."""
    return {k: v.detach().float().cpu().clone()
            for k, v in strategy.extended.export_state_dict(model).items()}


def one_device_meta_initial(device):
    """The documented procedure on one device: the meta model materialised whole on
    `device`, each module with tensors of its own reset in model.modules() order."""
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = Net()
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if list(module.parameters(recurse=False)):
                module.reset_parameters()
    return cpu_state(model)


def sharded_against_fsdp2(pretrained_path):
    """Under ts.launch (one replica): ShardedStrategy(mixed_precision=torch.bfloat16) with
    a model built on meta, and with one loaded by ts.load_pretrained, each trained against
    the same model sharded by hand with fully_shard (bf16 parameters in compute, float32
    reduction) from the same values; returns every state compared."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard   # FSDP2

    # The default where this torch's FSDP2 supports it (2.13); the GPU machine's 2.11 does
    # not, and the model uses the same parameters every step either way.
    strategy = ts.ShardedStrategy(
        mixed_precision=torch.bfloat16,
        same_parameters_every_step=not plan.fsdp_reduces_unused_parameters())
    ext = strategy.extended
    device = ext.torch_device
    deterministic(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def by_hand(state):
        model = Net().to(device)
        model.load_state_dict(state)
        for block in model.blocks:
            fully_shard(block, mesh=ext.mesh, mp_policy=policy)
        fully_shard(model, mesh=ext.mesh, mp_policy=policy)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def train(model, optimizer, in_run):
        def step(tokens, targets):
            token_loss(model, tokens, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        for tokens, targets in token_batches():
            args = (tokens.to(device), targets.to(device))
            strategy.run(step, args=args) if in_run else step(*args)

    def ours_on_meta():
        with strategy.scope():
            with torch.device("meta"):
                model = Net()
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, optimizer

    torch.manual_seed(SEED)
    model, optimizer = ours_on_meta()
    result = {"device": str(device), "compute_dtype": None,
              "initial": exported(strategy, model),
              "one_device_initial": one_device_meta_initial(device)}
    seen = []
    hook = model.blocks[0].up.register_forward_hook(
        lambda module, args, output: seen.append(output.dtype))
    hand, hand_optimizer = by_hand({k: v.to(device) for k, v in result["initial"].items()})
    train(model, optimizer, in_run=True)
    hook.remove()
    result["compute_dtype"] = str(seen[0])
    train(hand, hand_optimizer, in_run=False)
    result["ours"] = exported(strategy, model)
    result["fsdp2"] = full_state(hand)

    pretrained = torch.load(pretrained_path, weights_only=True)
    model, optimizer = ours_on_meta()
    ts.load_pretrained(model, pretrained_path)
    result["loaded"] = exported(strategy, model)
    hand, hand_optimizer = by_hand({k: v.to(device) for k, v in pretrained.items()})
    train(model, optimizer, in_run=True)
    train(hand, hand_optimizer, in_run=False)
    result["pretrained_ours"] = exported(strategy, model)
    result["pretrained_fsdp2"] = full_state(hand)
    return result


# -- TPUStrategy on torch_xla's CUDA device -----------------------------------------------
def xla_on_cuda(out):
    """TPUStrategy on the devices of PJRT_DEVICE=CUDA against a plain CPU loop: ConvNet,
    SGD with momentum, the same global batches; saves both final states and the losses."""
    strategy = ts.TPUStrategy()
    torch.manual_seed(SEED)
    with strategy.scope():
        model = ConvNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    initial = cpu_state(model)

    def step(x, y):
        loss = summed_loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    losses = []
    for x, y in strategy.experimental_distribute_dataset(batches()):
        loss = strategy.run(step, args=(x, y))
        losses.append(strategy.reduce("SUM", loss, axis=None).cpu())
    plain = ConvNet()
    plain.load_state_dict(initial)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain_losses = []
    for x, y in batches():
        loss = summed_loss(plain, x, y)
        loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        plain_losses.append(loss.detach())
    torch.save({"replicas": strategy.num_replicas_in_sync, "ours": cpu_state(model),
                "plain": cpu_state(plain), "losses": torch.stack(losses),
                "plain_losses": torch.stack(plain_losses)}, out)


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    if name == "world_one":
        torch.save(world_one(), args[0])
    elif name == "xla_on_cuda":
        xla_on_cuda(args[0])
    elif name == "shared_device":
        shared_device(int(args[0]), args[1], args[2])
    else:
        raise SystemExit(f"unknown case {name!r}")
