"""Sharded state routed between its sharded and its full (single-device) forms.

- `export_state_dict` / `export_optimizer_state_dict`: the plain single-device
  ``state_dict`` of a sharded model (and of its optimizer, keyed by parameter name), on the
  chief;
- `load_full_state_dict` / `load_full_optimizer_state_dict`: those loaded back, each
  replica keeping its shards;
- `route_full_state_dicts`: ``model.load_state_dict(full)`` of a sharded model takes a
  plain (MirroredStrategy, single-device) ``state_dict``: each replica keeps the part of
  every tensor its shard covers (`local_region`).

Sharded checkpoint directories (DCP with checksums) are `dcp_io`'s; optimizers built
before sharding are `stale`'s.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchstrategy.strategies.sharding import stale

def is_sharded(module: Any) -> bool:
    """True if `module` holds at least one DTensor parameter."""
    return isinstance(module, torch.nn.Module) and any(
        isinstance(p, DTensor) for p in module.parameters())


def _full(cpu_offload: bool = True) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def export_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The plain single-device ``state_dict`` of a sharded `model` (a collective: every
    replica calls it): full tensors on the CPU, no DTensors, the keys of the unwrapped
    model. The chief (replica 0) gets it, the other replicas an empty dict."""
    return get_model_state_dict(model, options=_full())


def export_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                                ) -> dict[str, Any]:
    """The full ``state_dict`` of an optimizer over `model`'s sharded parameters, keyed by
    parameter name (a collective; the chief gets it, the others an empty dict)."""
    stale.stale_parameters().refresh_optimizer(optimizer)
    return get_optimizer_state_dict(model, optimizer, options=_full())


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """Loads a plain (full, unsharded) ``state_dict`` into a sharded `model`: every
    replica passes the same dict and keeps its shard. Missing or unexpected keys raise."""
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                                   state_dict: dict[str, Any]) -> None:
    """Loads what `export_optimizer_state_dict` returned (on every replica)."""
    stale.stale_parameters().refresh_optimizer(optimizer)
    set_optimizer_state_dict(model, optimizer, state_dict,
                             options=StateDictOptions(full_state_dict=True))


# -- full tensors into shards ------------------------------------------------------------
def local_region(tensor: DTensor) -> tuple[slice, ...]:
    """The part of the full tensor that `tensor`'s local shard holds, as one slice per
    dimension, computed from its placements and this replica's mesh coordinate with
    DTensor's even split (``torch.chunk``: ceil(n / k) rows per shard, the last ones
    shorter or empty), the placements applied in mesh order.

    Raises:
      ValueError: a placement other than Shard / Replicate (a Partial tensor has no full
        value to slice; strided shards of nested parallelism are not supported).
    """
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("This process is not part of the tensor's device mesh.")
    starts = [0] * tensor.dim()
    sizes = list(tensor.shape)
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            raise ValueError(f"Cannot load full tensors into a DTensor placed as "
                             f"{list(tensor.placements)}: only Shard(dim) and Replicate are "
                             "supported.")
        dim = placement.dim % tensor.dim()
        parts = mesh.size(mesh_dim)
        chunk = -(-sizes[dim] // parts)
        start = min(coordinate[mesh_dim] * chunk, sizes[dim])
        starts[dim] += start
        sizes[dim] = max(0, min(chunk, sizes[dim] - start))
    local_shape = list(tensor.to_local().shape)
    if sizes != local_shape:  # DTensor changed its split: refuse rather than misplace data
        raise RuntimeError(f"The local shard of a {list(tensor.shape)} DTensor placed as "
                           f"{list(tensor.placements)} is {local_shape}, not the {sizes} of an "
                           "even split; torchstrategy does not know how it was split.")
    return tuple(slice(start, start + size) for start, size in zip(starts, sizes))


def _shard_full_tensors(module: torch.nn.Module, state_dict: dict[str, Any], prefix: str,
                        local_metadata: Any, strict: bool, missing_keys: list[str],
                        unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """``load_state_dict`` pre-hook of a module holding sharded parameters: a full plain
    tensor given for one of them is replaced by a DTensor holding this replica's part of it,
    which the parameter's own ``copy_`` then takes (no communication). Anything else (a
    DTensor, a tensor of the wrong shape: torch reports it) is left to torch."""
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and \
                not isinstance(value, DTensor) and value.shape == param.shape:
            if local_metadata.get("assign_to_params_buffers"):
                # The plain tensor would replace FSDP2's sharded parameter: torch must not
                # see it (the parameter stays as it was) and load_state_dict raises.
                del state_dict[prefix + name]
                error_msgs.append(
                    f"{prefix + name}: load_state_dict(assign=True) cannot replace a "
                    "parameter ShardedStrategy sharded by a full tensor; load without "
                    "assign=True (each replica keeps its part), or use ts.load_pretrained.")
                continue
            local = param.to_local()
            part = value.detach()[local_region(param)].to(device=local.device,
                                                           dtype=local.dtype)
            state_dict[prefix + name] = DTensor.from_local(
                part, param.device_mesh, param.placements, run_check=False,
                shape=param.shape, stride=param.stride())
    return None


def route_full_state_dicts(root: torch.nn.Module) -> None:
    """Makes ``load_state_dict`` of `root` (just sharded), or of any of its modules, accept
    full plain tensors for the sharded parameters, as a MirroredStrategy or single-device
    checkpoint holds them; every replica passes the same full ``state_dict``."""
    for module in root.modules():
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            module.register_load_state_dict_pre_hook(_shard_full_tensors)
