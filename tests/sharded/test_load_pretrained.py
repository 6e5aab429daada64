"""ts.load_pretrained: pretrained weights streamed into a sharded model, each replica reading
only its shards.

One launch of 2 replicas checks:
- a torch.save file (memory-mapped), a safetensors file, a plain DCP directory and one
  written by ShardedStrategy's save_checkpoint ("model." keys) each load into a sharded
  model exactly as ``load_state_dict`` of the same state_dict loads into an unsharded one
  (bit for bit; shards of uneven size, a 0-dim buffer); also on a 2-D (hybrid) mesh and
  under MirroredStrategy; a model still on meta is refused, naming the key;
- a missing key, an unexpected key and a shape mismatch raise on every replica, naming the
  key, before anything is copied; strict=False loads the common keys and returns the others;
- the proof that a replica reads only its slices: the elements safetensors materialises
  equal the replica's local shards (counted through a safe_open wrapper), and the peak
  resident memory a load adds is about half the file on each of 2 replicas (memory-mapped
  pages touched), where reading the whole file adds all of it.
One device (no strategy) in this process: the same files, the same result.
"""
import os

import pytest
import torch
import torch.distributed
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import torchstrategy as ts
from tests.helpers.replicas import from_every_replica, launch

safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="safetensors is not installed (scripts/setup.sh installs it)")

pytestmark = pytest.mark.timeout(240)

BIG_WIDTH, BIG_LAYERS = 1024, 6     # 24 MiB of float32 weights: the memory measurement


class Net(nn.Module):
    """Uneven shards on 2 replicas (33 and 5 rows, 7-row Linear), a 0-dim buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.hidden = nn.Linear(8, 33)
        self.norm = nn.BatchNorm1d(33)
        self.layers = nn.ModuleList([nn.Linear(33, 33) for _ in range(2)])
        self.head = nn.Linear(33, 5)

    def forward(self, tokens):
        x = self.norm(self.hidden(self.embed(tokens)))
        for layer in self.layers:
            x = layer(x).relu()
        return self.head(x)


def pretrained_state(seed):
    """A state_dict unlike any initialisation (a pretrained model's), buffers included."""
    torch.manual_seed(seed)
    state = Net().state_dict()
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, value in state.items():
        if value.dtype.is_floating_point:
            out[key] = torch.randn(value.shape, generator=g)
        else:
            out[key] = torch.tensor(seed * 10, dtype=value.dtype)  # num_batches_tracked
    return out


def unsharded(state):
    """The reference: the full state_dict loaded into an unsharded model."""
    model = Net()
    model.load_state_dict(state)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_sources(directory):
    """The pretrained files, one format each (a different state in each, so a format
    that loads nothing cannot pass on the previous one's values)."""
    sources = {}
    sources["torch"] = os.path.join(directory, "net.pt")
    torch.save(pretrained_state(1), sources["torch"])
    sources["safetensors"] = os.path.join(directory, "net.safetensors")
    safetensors_torch.save_file(pretrained_state(2), sources["safetensors"])
    sources["dcp"] = os.path.join(directory, "net-dcp")
    dcp.save(pretrained_state(3), checkpoint_id=sources["dcp"], no_dist=True)
    for name, bad in (("missing", {k: v for k, v in pretrained_state(5).items()
                                   if k != "layers.1.weight"}),
                      ("unexpected", {**pretrained_state(5), "extra.weight": torch.ones(2)}),
                      ("shape", {**pretrained_state(5), "head.weight": torch.ones(5, 32)})):
        sources[name] = os.path.join(directory, f"{name}.safetensors" if name == "shape"
                                     else f"{name}.pt")
        if name == "shape":
            safetensors_torch.save_file(bad, sources[name])
        else:
            torch.save(bad, sources[name])
    big = nn.Sequential(*[nn.Linear(BIG_WIDTH, BIG_WIDTH, bias=False)
                          for _ in range(BIG_LAYERS)])
    sources["big-torch"] = os.path.join(directory, "big.pt")
    torch.save(big.state_dict(), sources["big-torch"])
    sources["big-safetensors"] = os.path.join(directory, "big.safetensors")
    safetensors_torch.save_file(big.state_dict(), sources["big-safetensors"])
    return sources


def export(strategy, model):
    return strategy.extended.export_state_dict(model)


def assert_exact(got, expected, what):
    assert list(got) == list(expected), what
    for key in expected:
        assert got[key].dtype == expected[key].dtype, (what, key)
        assert torch.equal(got[key], expected[key]), f"{what}: {key} differs"


def error_of(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test reports the type and message
        return type(error).__name__, str(error)
    return None


def drop_from_page_cache(path):
    """A page already in the page cache is mapped in with its neighbours when one of them
    is read through a memory map, which would count pages never read."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def peak_rss_added(fn, path, barrier=lambda: None):
    """Peak resident memory (bytes) added while `fn` reads the file `path` through a
    memory map: the file leaves the page cache (every replica does it, then they meet at
    `barrier`), and the kernel's high-water mark is reset to the current size
    (/proc/self/clear_refs)."""
    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(field)
    drop_from_page_cache(path)
    barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    fn()
    return status("VmHWM") - before


class CountingSafeOpen:
    """safetensors.safe_open, counting the elements every slice and tensor read
    materialises."""

    def __init__(self, real):
        self.real, self.elements, self.whole = real, 0, []

    def __call__(self, *args, **kwargs):
        counter = self
        handle = self.real(*args, **kwargs)

        class Slice:
            def __init__(self, inner):
                self.inner = inner

            def get_shape(self):
                return self.inner.get_shape()

            def __getitem__(self, index):
                out = self.inner[index]
                counter.elements += out.numel()
                return out

        class Handle:
            def __enter__(self):
                self.opened = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.opened.keys()

            def get_slice(self, key):
                return Slice(self.opened.get_slice(key))

            def get_tensor(self, key):
                out = self.opened.get_tensor(key)
                counter.elements += out.numel()
                counter.whole.append(key)
                return out
        return Handle()


def replica(sources, checkpoint_dir):
    import safetensors
    strategy = ts.ShardedStrategy()
    chief = strategy.extended.should_checkpoint
    with strategy.scope():
        torch.manual_seed(0)
        model = Net()
    assert isinstance(model.hidden.weight, DTensor)
    rows = model.hidden.weight.to_local().shape[0]
    assert rows == (17 if chief else 16)  # uneven shards

    for name, seed in (("torch", 1), ("safetensors", 2), ("dcp", 3)):
        result = ts.load_pretrained(model, sources[name])
        assert result == ([], [])
        got = export(strategy, model)
        if chief:
            assert_exact(got, unsharded(pretrained_state(seed)), name)

    # A 2-D mesh (replicate x shard; one replica per shard group: Replicate, then Shard
    # over 1), and a model still on meta inside the scope.
    hybrid = ts.ShardedStrategy(shard_group_size=1)
    with hybrid.scope():
        replicated = Net()
        with torch.device("meta"):
            on_meta = Net()
        errors_meta = error_of(lambda: ts.load_pretrained(on_meta, sources["torch"]))
    assert [type(p).__name__ for p in replicated.hidden.weight.placements] == \
        ["Replicate", "Shard"]
    ts.load_pretrained(replicated, sources["safetensors"])
    got = export(hybrid, replicated)
    if chief:
        assert_exact(got, unsharded(pretrained_state(2)), "2-D mesh")
    assert errors_meta[0] == "ValueError" and "'embed.weight' is on the meta device" in \
        errors_meta[1] and "after the strategy.scope()" in errors_meta[1], errors_meta

    # A checkpoint of ShardedStrategy's own ("model." keys, optimizer beside).
    with strategy.scope():
        torch.manual_seed(4)
        other = Net()
        optimizer = torch.optim.Adam(other.parameters(), lr=0.1)
    other(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    strategy.extended.save_checkpoint(checkpoint_dir, other, optimizer)
    expected = export(strategy, other)
    ts.load_pretrained(model, checkpoint_dir)
    got = export(strategy, model)  # a collective: every replica
    if chief:
        assert_exact(got, expected, "save_checkpoint's directory")

    # Errors: on every replica, naming the key, before anything is copied.
    before = export(strategy, model)
    errors = {}
    for name in ("missing", "unexpected", "shape"):
        errors[name] = from_every_replica(
            error_of(lambda: ts.load_pretrained(model, sources[name])))
        got = export(strategy, model)
        if chief:
            assert_exact(got, before, f"after the {name} error")
    errors["no file"] = from_every_replica(
        error_of(lambda: ts.load_pretrained(model, sources["torch"] + ".nothing")))
    lenient = {name: ts.load_pretrained(model, sources[name], strict=False)
               for name in ("missing", "unexpected")}
    after = export(strategy, model)
    if chief:
        expected = unsharded(pretrained_state(5))
        assert_exact(after, expected, "strict=False")

    # The proof: each replica reads its slices only.
    with strategy.scope():
        big = nn.Sequential(*[nn.Linear(BIG_WIDTH, BIG_WIDTH, bias=False)
                              for _ in range(BIG_LAYERS)])
    local = sum(p.to_local().numel() for p in big.parameters())
    real = safetensors.safe_open
    counting = safetensors.safe_open = CountingSafeOpen(real)
    try:
        ts.load_pretrained(big, sources["big-safetensors"])
    finally:
        safetensors.safe_open = real

    def read_everything():
        whole = torch.load(sources["big-torch"], mmap=True, weights_only=True)
        return sum(float(v.sum()) for v in whole.values())
    added = {}
    for name in ("torch", "safetensors"):   # a collective: both replicas at once
        path = sources[f"big-{name}"]
        added[name] = peak_rss_added(lambda: ts.load_pretrained(big, path), path,
                                     torch.distributed.barrier)
    for turn in range(2):  # one replica at a time: the other's reads would cache pages
        if turn == strategy.extended.replica_id:
            added["whole file"] = peak_rss_added(read_everything, sources["big-torch"])
        torch.distributed.barrier()
    measured = {"safetensors elements": counting.elements, "local elements": local,
                "whole tensors": counting.whole,
                "file bytes": os.path.getsize(sources["big-torch"]), "rss added": added}

    # MirroredStrategy's (plain) parameters: the same call, each replica reads it all.
    mirrored = ts.MirroredStrategy()
    with mirrored.scope():
        plain = Net()
    ts.load_pretrained(plain, sources["safetensors"])
    assert_exact({k: v.detach() for k, v in plain.state_dict().items()},
                 unsharded(pretrained_state(2)), "MirroredStrategy")
    return errors, lenient, from_every_replica(measured)


def test_load_pretrained_into_shards(tmp_path):
    sources = write_sources(str(tmp_path))
    errors, lenient, measured = launch(replica, sources, str(tmp_path / "ckpt"), n=2)

    for name, expected in (("missing", ["KeyError", "'layers.1.weight'", "missing from it"]),
                           ("unexpected", ["KeyError", "'extra.weight'", "not in the model"]),
                           ("shape", ["ValueError", "'head.weight'", "[5, 32]", "[5, 33]"]),
                           ("no file", ["FileNotFoundError", ".nothing"])):
        assert errors[name][0] == errors[name][1], errors[name]  # every replica, the same
        kind, message = errors[name][0]
        assert kind == expected[0], (name, kind, message)
        for part in expected[1:]:
            assert part in message, (name, message)
    assert "strict=False" in errors["missing"][0][1]
    assert lenient["missing"] == (["layers.1.weight"], [])
    assert lenient["unexpected"] == ([], ["extra.weight"])

    total = BIG_WIDTH * BIG_WIDTH * BIG_LAYERS
    for rank, facts in enumerate(measured):
        # Exactly the local shards were materialised, no tensor whole.
        assert facts["safetensors elements"] == facts["local elements"] == total // 2, facts
        assert facts["whole tensors"] == []
        file_bytes, added = facts["file bytes"], facts["rss added"]
        print(f"replica {rank}: peak RSS added / file size: "
              + ", ".join(f"{k} {v / file_bytes:.2f}" for k, v in added.items()))
        # Half the file's pages are touched (plus a little); reading it whole touches all.
        assert added["torch"] <= 0.65 * file_bytes, added
        assert added["safetensors"] <= 0.65 * file_bytes, added
        assert added["whole file"] >= 0.9 * file_bytes, added


def test_one_device_loads_the_same(tmp_path):
    sources = write_sources(str(tmp_path))
    for name, seed in (("torch", 1), ("safetensors", 2), ("dcp", 3)):
        model = Net()
        assert ts.load_pretrained(model, sources[name]) == ([], [])
        assert_exact({k: v.detach() for k, v in model.state_dict().items()},
                     unsharded(pretrained_state(seed)), name)
    # bf16 weights into a float32 model: converted, as load_state_dict does.
    low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
           for k, v in pretrained_state(6).items()}
    for name in ("pt", "safetensors", "dcp"):
        path = str(tmp_path / f"bf16.{name}")
        if name == "pt":
            torch.save(low, path)
        elif name == "safetensors":
            safetensors_torch.save_file(low, path)
        else:
            dcp.save(low, checkpoint_id=path, no_dist=True)
        model = Net()
        ts.load_pretrained(model, path)
        assert_exact({k: v.detach() for k, v in model.state_dict().items()},
                     unsharded({k: v.float() if v.is_floating_point() else v
                                for k, v in low.items()}), f"bf16 {name}")
    with pytest.raises(KeyError, match=r"'layers\.1\.weight'"):
        ts.load_pretrained(Net(), sources["missing"])
    with pytest.raises(ValueError, match=r"'head\.weight' has shape \[5, 32\] there"):
        ts.load_pretrained(Net(), sources["shape"])
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="neither a torch.save file"):
        ts.load_pretrained(Net(), str(junk))
