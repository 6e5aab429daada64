"""Nested structures (dict, list, tuple, namedtuple) of values, as tf.nest handles them.

Built on torch's pytree (through _compat), the structure library torch itself uses, so every
container torch knows (including user-registered ones) works here too.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torchstrategy import _compat


def flatten(structure: Any) -> tuple[list[Any], _compat.TreeSpec]:
    """Returns ``(leaves, spec)``; `pack(spec, leaves)` rebuilds the structure."""
    return _compat.tree_flatten(structure)


def pack(spec: _compat.TreeSpec, leaves: Iterable[Any]) -> Any:
    """Inverse of `flatten`."""
    return _compat.tree_unflatten(list(leaves), spec)


def map_structure(fn: Callable[..., Any], structure: Any) -> Any:
    """Applies `fn` to every leaf, keeping the structure."""
    return _compat.tree_map(fn, structure)


def tensor_leaves(structure: Any, what: str) -> tuple[list[torch.Tensor], _compat.TreeSpec]:
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


def check_axis(tensor: torch.Tensor, axis: int, index: int) -> None:
    """Refuses an `axis` that is not a dimension of `tensor` (leaf `index` of a structure;
    a 0-dim tensor has none).

    Raises:
      ValueError: naming the axis, the leaf and its shape.
    """
    if tensor.dim() == 0 or not -tensor.dim() <= axis < tensor.dim():
        raise ValueError(f"axis {axis} is out of range for leaf {index} of shape "
                         f"{tuple(tensor.shape)}.")


def check_gatherable(tensor: torch.Tensor, axis: int, index: int) -> None:
    """Refuses to gather a 0-dim tensor (leaf `index`) along `axis`.

    Raises:
      ValueError: saying how to give it a dimension.
    """
    if tensor.dim() == 0:
        raise ValueError(f"Cannot gather a scalar (leaf {index}) along axis {axis}; give it "
                         "a dimension first, e.g. t.reshape(1).")
