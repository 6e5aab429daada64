"""Shared helpers for the tests/test_core_*.py suites (multi-process tests via ts.launch).

Replica functions must live at module level of an importable module (ts.launch pickles them
by reference); the repository root is on sys.path, so the launched replicas import the test
modules and this one by name.
"""
import torch
import torch.distributed as dist

import torchstrategy as ts

LAUNCH_TIMEOUT = 60


def launch(fn, *args, n):
    """Runs ``fn(*args)`` as `n` replicas on gloo and returns replica 0's result."""
    return ts.launch(fn, *args, num_replicas=n, timeout_seconds=LAUNCH_TIMEOUT)


def from_every_replica(obj):
    """Inside a replica: returns the list of every replica's `obj`, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def detached_state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def grads_of(module):
    return {name: (None if p.grad is None else p.grad.detach().clone())
            for name, p in module.named_parameters()}


def assert_same_tensors(a, b, atol=0.0, rtol=0.0, what=""):
    """Same keys, and every tensor close (exactly equal by default)."""
    assert list(a.keys()) == list(b.keys()), what
    for key in a:
        x, y = a[key], b[key]
        if x is None or y is None:
            assert x is None and y is None, f"{what} {key}: {x} vs {y}"
            continue
        assert x.dtype == y.dtype, f"{what} {key}: {x.dtype} vs {y.dtype}"
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol, msg=lambda m: f"{what} {key}: {m}")


def local(structure):
    """Replaces every distributed value (PerReplica / Mirrored) by this replica's component."""
    return ts.nest.map_structure(
        lambda leaf: leaf.values[0] if isinstance(leaf, ts.values.DistributedValues) else leaf,
        structure)
