"""The data-parallel device mesh of `TPUStrategy`: every XLA device on one axis, "data".

torch_xla's SPMD mode runs one program per host over all its devices: tensors carry a
sharding (how they are split over the mesh) and XLA partitions the traced step accordingly.
Parameters are replicated (every device holds all of them); batches are split along dim 0.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from torchstrategy.xla import require_torch_xla

AXIS = "data"


class DataMesh:
    """A 1-D mesh over every XLA device of the job (all hosts), and the shardings of
    replicated state and of dim-0-split batches on it.

    Constructing one switches torch_xla to SPMD mode (``torch_xla.runtime.use_spmd()``),
    which must happen before any tensor is put on an XLA device.
    """

    def __init__(self) -> None:
        require_torch_xla()
        # torch_xla is an optional dependency: imported only once a TPUStrategy is made.
        import torch_xla
        import torch_xla.runtime as xr
        import torch_xla.distributed.spmd as xs

        if not xr.is_spmd():
            xr.use_spmd()
        self._xs = xs
        self.num_devices = xr.global_runtime_device_count()
        self.num_local_devices = xr.addressable_runtime_device_count()
        self.process_count = xr.process_count()
        self.process_index = xr.process_index()
        self.device = torch_xla.device()
        self.mesh = xs.Mesh(list(range(self.num_devices)), (self.num_devices,), (AXIS,))
        self._specs: dict[int, Any] = {}

    def batch_spec(self, dim: int) -> Any:
        """The sharding of a `dim`-dimensional batch tensor: split along dim 0. With several
        hosts each host supplies its own rows (torch_xla's "minibatch" input)."""
        spec = self._specs.get(dim)
        if spec is None:
            spec = self._xs.ShardingSpec(self.mesh, (AXIS,) + (None,) * (dim - 1),
                                         minibatch=self.process_count > 1)
            self._specs[dim] = spec
        return spec

    def shard_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """Annotates an XLA tensor as split along dim 0 over the mesh (in place) and returns
        it. A 0-dim tensor stays replicated."""
        if tensor.dim() > 0:
            self._xs.mark_sharding(tensor, self.mesh, (AXIS,) + (None,) * (tensor.dim() - 1))
        return tensor

    def batch_to_device(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Copies host (CPU) tensors to the mesh, each split along dim 0 as it is copied (no
        device ever receives rows it does not hold); 0-dim tensors are replicated."""
        import torch_xla.core.xla_model as xm  # optional dependency (see __init__)

        out = []
        for t in tensors:
            if t.device.type != "cpu":
                t = t.cpu()
            spec = self.batch_spec(t.dim()) if t.dim() > 0 else None
            out.append(xm.send_cpu_data_to_device(t, self.device, spec)[0])
        return out

    def replicate_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copies a tensor to the mesh, replicated on every device."""
        return tensor.to(self.device)


def is_xla(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "xla"
