"""Nested structures (dict, list, tuple, namedtuple) of values, as tf.nest handles them.

Built on torch's pytree (through _compat), the structure library torch itself uses, so every
container torch knows (including user-registered ones) works here too.
"""
import torch
from torchstrategy import _compat


def flatten(structure):
    """Returns ``(leaves, spec)``; `pack(spec, leaves)` rebuilds the structure."""
    return _compat.tree_flatten(structure)


def pack(spec, leaves):
    """Inverse of `flatten`."""
    return _compat.tree_unflatten(list(leaves), spec)


def map_structure(fn, structure):
    """Applies `fn` to every leaf, keeping the structure."""
    return _compat.tree_map(fn, structure)


def tensor_leaves(structure, what):
    """Flattens `structure` and checks that every leaf is a tensor (or a Python number,
    converted to a tensor).

    Raises:
      TypeError: naming the offending leaf's position and type, and what needed a tensor.
    """
    leaves, spec = flatten(structure)
    out = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif isinstance(leaf, (bool, int, float)):
            out.append(torch.as_tensor(leaf))
        else:
            raise TypeError(f"{what} needs tensors, but leaf {index} of the structure is a "
                            f"{type(leaf).__name__} ({leaf!r:.60}). Pass tensors (or Python "
                            "numbers) only.")
    return out, spec
