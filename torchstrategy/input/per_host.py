"""Distributed input for strategies that run several replicas in one process
(CentralStorageStrategy).

- `PerHostDataset` (``experimental_distribute_dataset``): the loader yields *global*
  batches; each is split along dim 0 exactly as the SPMD strategies split it (replica r
  takes slice r, a short last batch is split as evenly as possible, the first replicas
  taking the extra rows, and a replica with nothing left gets an empty slice of the right
  structure), each slice moved to its replica's compute device. One `PerReplica` per leaf.
- `PerHostDatasetsFromFunction` (``distribute_datasets_from_function``): as in TensorFlow,
  ``dataset_fn`` is called once for this process (``num_input_pipelines=1``) and yields
  *per-replica* batches; each step gives consecutive batches to replicas 0, 1, ...; when it
  runs out in the middle of a step the remaining replicas get empty batches.

Both iterate as a `DistributedIterator` (``get_next``, ``get_next_as_optional``,
``element_spec``) and have ``reduce``. The replicas share one process and one iterator, so
a step exists for all of them or for none. As in TensorFlow, ``InputReplicationMode
.PER_REPLICA`` is refused (TensorFlow supports it only in MirroredStrategy).
``experimental_per_replica_buffer_size`` steps are copied to accelerators ahead of use.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from torchstrategy import nest, values
from torchstrategy.input.contexts import InputContext, InputOptions, check_input_options
from torchstrategy.input.distributed_dataset import (DistributedIterator, ReducibleInput,
                                                     _empty_like_batch, _slice_batch,
                                                     lookahead)


class _PerHostInput(ReducibleInput):
    def __init__(self, devices: Iterable[torch.device], options: InputOptions | None,
                 from_function: bool) -> None:
        self._devices = list(devices)
        self._options = check_input_options(options, from_function=from_function,
                                            per_replica_supported=False,
                                            where="CentralStorageStrategy")
        accelerators = any(device.type != "cpu" for device in self._devices)
        self._depth = self._options.experimental_per_replica_buffer_size if accelerators else 0

    def _to_device(self, batch: Any, device: torch.device) -> Any:
        if not self._options.experimental_fetch_to_device or device.type == "cpu":
            return batch
        return nest.map_structure(
            lambda leaf: leaf.to(device, non_blocking=True)
            if isinstance(leaf, torch.Tensor) else leaf, batch)

    def _distribute(self, parts: Sequence[Any]) -> Any:
        return values.per_replica(self._to_device(part, device)
                                  for part, device in zip(parts, self._devices))

    def _iterator(self, steps: Iterable[Any]) -> DistributedIterator:
        # One process holds every replica: a step exists for all of them or for none.
        return DistributedIterator(lookahead(steps, self._depth), lambda have: have)


class PerHostDataset(_PerHostInput):
    """The result of ``experimental_distribute_dataset`` (see the module docstring)."""

    def __init__(self, dataset: Iterable[Any], devices: Iterable[torch.device],
                 options: InputOptions | None = None) -> None:
        super().__init__(devices, options, from_function=False)
        self._dataset = dataset

    def __iter__(self) -> DistributedIterator:
        return self._iterator(self._steps())

    def _steps(self) -> Iterator[Any]:
        n = len(self._devices)
        for batch in self._draw():
            yield self._distribute([_slice_batch(batch, n, r) for r in range(n)])

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]  # TypeError if it has none


class PerHostDatasetsFromFunction(_PerHostInput):
    """The result of ``distribute_datasets_from_function`` (see the module docstring)."""

    def __init__(self, dataset_fn: Callable[[InputContext], Iterable[Any]],
                 devices: Iterable[torch.device], options: InputOptions | None = None
                 ) -> None:
        super().__init__(devices, options, from_function=True)
        self._context = InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                     num_replicas_in_sync=len(self._devices))
        self._dataset = dataset_fn(self._context)

    def __iter__(self) -> DistributedIterator:
        return self._iterator(self._steps())

    def _steps(self) -> Iterator[Any]:
        n = len(self._devices)
        iterator = self._draw()
        while True:
            parts = []
            for batch in iterator:
                parts.append(batch)
                if len(parts) == n:
                    break
            if not parts:
                return
            missing = n - len(parts)
            parts += [_empty_like_batch(parts[0])] * missing
            yield self._distribute(parts)
            if missing:
                return

    def __len__(self) -> int:
        n = len(self._devices)
        return -(-len(self._dataset) // n)  # type: ignore[arg-type]  # TypeError if none
