"""Distributed input for `TPUStrategy`: global batches split along dim 0 over the XLA mesh,
copied to the devices ahead of use by a background thread.

torch_xla's own loader (``MpDeviceLoader`` / ``ParallelLoader``) shards input with one
sharding for every tensor of a batch, so a batch of images and labels (tensors of different
ranks) would not be split; the prefetcher here gives each tensor the dim-0 split of its own
rank, through torch_xla's public ``send_cpu_data_to_device``, and leaves graph cuts to the
strategy (``steps_per_execution``).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from torchstrategy import nest
from torchstrategy.context import AnyStrategy
from torchstrategy.input.contexts import InputContext, InputOptions, check_input_options
from torchstrategy.input.distributed_dataset import (DistributedIterator, ReducibleInput,
                                                     ShardedLoader, _is_shardable_loader,
                                                     _slice_batch)
from torchstrategy.xla.mesh import DataMesh

# Batches copied to the devices ahead of the step using them (torch_xla's loader also keeps 2).
PREFETCH_DEPTH = 2
_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def to_mesh(batch: Any, mesh: DataMesh) -> Any:
    """`batch` with its tensor leaves on the mesh, split along dim 0."""
    leaves, spec = nest.flatten(batch)
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    with torch.no_grad():
        moved = mesh.batch_to_device([leaves[i] for i in where])
    for i, t in zip(where, moved):
        leaves[i] = t
    return nest.pack(spec, leaves)


def prefetch_to_device(batches: Iterable[Any], mesh: DataMesh, depth: int = PREFETCH_DEPTH
                       ) -> Iterator[Any]:
    """Yields each host batch of `batches` with its tensor leaves on the mesh (split along
    dim 0), copying up to `depth` batches ahead in a background thread. An exception in the
    host pipeline is raised here, in the consumer; leaving the loop early stops the thread.
    """
    slots: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not put(to_mesh(batch, mesh)):
                    return
            put(_END)
        except BaseException as error:  # handed to the consumer, never lost in the thread
            put(_Failure(error))

    worker = threading.Thread(target=produce, name="torchstrategy-xla-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            item = slots.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        worker.join(timeout=10)


class _TPUInputBase(ReducibleInput):
    def __init__(self, strategy: AnyStrategy, options: InputOptions | None) -> None:
        self._ext = strategy.extended
        # PER_REPLICA replication is refused, as TensorFlow's TPUStrategy refuses it.
        self._options = check_input_options(options, from_function=True,
                                            per_replica_supported=False, where="TPUStrategy")

    def _deliver_all(self, host_batches: Iterable[Any]) -> Iterator[Any]:
        if not self._options.experimental_fetch_to_device:
            yield from host_batches
            return
        # InputOptions.experimental_per_replica_buffer_size batches ahead (0: each batch is
        # copied when it is taken).
        depth = self._options.experimental_per_replica_buffer_size
        mesh = self._ext.mesh
        moved = (prefetch_to_device(host_batches, mesh, depth) if depth
                 else (to_mesh(batch, mesh) for batch in host_batches))
        for batch in moved:
            yield self._ext.wrap_global(batch)


class TPUDistributedDataset(_TPUInputBase):
    """``TPUStrategy.experimental_distribute_dataset(dataset)``: `dataset` yields *global*
    batches; each tensor arrives on the XLA devices split along dim 0, as a `GlobalValue`.

    With one host the loader is iterated as it is. With several hosts each host reads only
    its own rows of every global batch (a DataLoader over a map-style dataset is sharded at
    the sampler, the global batches being those the loader gives on host 0 used alone;
    any other iterable is read whole and sliced). A short last batch is split by XLA
    (``ceil(rows / devices)`` rows per device; the step computes on exactly the rows given,
    nothing padded into the math).
    """

    def __init__(self, strategy: AnyStrategy, dataset: Iterable[Any],
                 options: InputOptions | None = None) -> None:
        super().__init__(strategy, options)
        ext = self._ext
        self._dataset = dataset
        self._sharded: ShardedLoader | None = None
        self._epoch = 0
        self._hosts = ext.mesh.process_count
        self._host = ext.mesh.process_index
        if self._hosts > 1 and _is_shardable_loader(dataset):
            # The global batches are those the loader gives on host 0 used alone.
            self._sharded = ShardedLoader(dataset, self._hosts, self._host, ext.communicator)

    def set_epoch(self, epoch: int) -> None:
        """Records the epoch being started (for resuming); the order of an epoch is the one
        the loader's random state gives when it starts, as with the loader alone."""
        self._epoch = int(epoch)

    def _host_batches(self) -> Iterator[Any]:
        self._epoch += 1
        if self._sharded is not None:
            yield from self._sharded.batches()
            return
        for batch in self._dataset:
            if self._hosts > 1:
                batch = _slice_batch(batch, self._hosts, self._host)
            yield batch

    def __iter__(self) -> DistributedIterator:
        # One SPMD program over the global batch: a step exists for every replica or for
        # none, so get_next_as_optional needs no agreement.
        return DistributedIterator(self._deliver_all(self._host_batches()), lambda have: have)

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]  # TypeError if it has none


class TPUDistributedDatasetsFromFunction(_TPUInputBase):
    """``TPUStrategy.distribute_datasets_from_function(dataset_fn)``.

    As in tf.distribute, ``dataset_fn(ts.InputContext)`` builds one input pipeline per host
    (``input_pipeline_id`` = the host's index, ``num_input_pipelines`` = the number of hosts)
    yielding *per-replica* batches (``ctx.get_per_replica_batch_size(global_batch)`` rows);
    the strategy takes one batch per local device and concatenates them into the host's
    part of the global batch, so replica r's rows are the r-th batch drawn. If the pipeline
    ends part-way through a group, the batches drawn so far make a short last batch.
    """

    def __init__(self, strategy: AnyStrategy,
                 dataset_fn: Callable[[InputContext], Iterable[Any]],
                 options: InputOptions | None = None) -> None:
        super().__init__(strategy, options)
        mesh = self._ext.mesh
        self._context = InputContext(num_input_pipelines=mesh.process_count,
                                     input_pipeline_id=mesh.process_index,
                                     num_replicas_in_sync=mesh.num_devices)
        self._per_host = mesh.num_local_devices
        self._dataset = dataset_fn(self._context)

    def _host_batches(self) -> Iterator[Any]:
        group: list[Any] = []
        for batch in self._dataset:
            group.append(batch)
            if len(group) == self._per_host:
                yield _concatenate(group)
                group = []
        if group:
            yield _concatenate(group)

    def __iter__(self) -> DistributedIterator:
        # One SPMD program over the global batch: a step exists for every replica or for
        # none, so get_next_as_optional needs no agreement.
        return DistributedIterator(self._deliver_all(self._host_batches()), lambda have: have)

    def __len__(self) -> int:
        return -(-len(self._dataset) // self._per_host)  # type: ignore[arg-type]  # as above


def _concatenate(batches: Sequence[Any]) -> Any:
    if len(batches) == 1:
        return batches[0]
    flat = [nest.flatten(b) for b in batches]
    spec = flat[0][1]
    leaves = []
    for parts in zip(*[leaves for leaves, _ in flat]):
        if isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0:
            leaves.append(torch.cat(parts))
        else:
            leaves.append(parts[0])
    return nest.pack(spec, leaves)


__all__ = ["TPUDistributedDataset", "TPUDistributedDatasetsFromFunction",
           "prefetch_to_device", "to_mesh"]
