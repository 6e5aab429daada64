"""Distributing input: every replica gets its own slice of each global batch.

`DistributedDataset` (``strategy.experimental_distribute_dataset``) takes an iterable of
*global* batches and gives replica r slice r of each, along dim 0, exactly as tf.distribute
splits them: ``[0, 1, 2, 3]`` over two replicas is ``[0, 1]`` and ``[2, 3]``.

- A ``DataLoader`` over a map-style dataset is sharded at the sampler: each process's
  loader fetches only the indices of its own slice, never the whole global batch.
- Any other iterable (an ``IterableDataset`` loader, a generator, a list of tensors) is
  iterated whole by every replica, and each replica keeps its slice; it must yield the same
  batches on every replica.
- A short last batch is split as evenly as possible (sizes differ by at most one, the
  first replicas taking the extra rows); a replica with nothing left gets an empty slice
  with the right structure, dtype and trailing shape. Every replica therefore takes the
  same number of steps, and no sample is dropped or repeated.
- Shuffling is seeded identically on every replica (replica 0 picks the seed, broadcast
  once when the dataset is distributed; epoch e uses seed + e), so slices never overlap.
- Batches arrive on the replica's device, with tensor leaves wrapped as `PerReplica`.
"""
import collections
import copy
import itertools

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from torchstrategy import nest
from torchstrategy.input.contexts import InputContext, InputOptions


def split_bounds(total, num_replicas, replica_id):
    """(start, size) of replica `replica_id`'s share of `total` rows: an even split, the
    first ``total % num_replicas`` replicas taking one row more."""
    base, extra = divmod(total, num_replicas)
    start = replica_id * base + min(replica_id, extra)
    return start, base + (1 if replica_id < extra else 0)


def _slice_batch(batch, num_replicas, replica_id):
    def take(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            start, size = split_bounds(leaf.shape[0], num_replicas, replica_id)
            return leaf[start:start + size]
        return leaf
    return nest.map_structure(take, batch)


def _empty_like_batch(batch):
    return nest.map_structure(
        lambda leaf: leaf[:0] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf,
        batch)


class _ShardedBatchSampler(Sampler):
    """Yields, for each global batch of `batch_sampler`, only this replica's indices.

    Randomness is seeded with ``seed + epoch`` so every replica draws the same global
    batches. An empty share is fetched as one sample of the global batch (so collation
    sees a real sample) and recorded in `empty`, for the dataset to cut to zero rows.
    """

    def __init__(self, batch_sampler, num_replicas, replica_id, seed):
        self._num_replicas = num_replicas
        self._replica_id = replica_id
        self._seed = seed
        self._epoch = 0
        self._start_step = 0
        self.empty = collections.deque()
        self._inner = copy.copy(batch_sampler)
        self._generator = None
        sampler = getattr(self._inner, "sampler", None)
        if sampler is not None and hasattr(sampler, "generator"):
            # RandomSampler, SubsetRandomSampler, WeightedRandomSampler: give a copy our
            # generator (the user's sampler object is left untouched).
            self._inner.sampler = copy.copy(sampler)
            self._generator = torch.Generator()
            self._inner.sampler.generator = self._generator
        self._deterministic = isinstance(sampler, SequentialSampler)

    def set_epoch(self, epoch, start_step=0):
        self._epoch = epoch
        self._start_step = start_step

    def _global_batches(self):
        seed = self._seed + self._epoch
        if self._generator is not None:
            self._generator.manual_seed(seed)
            return iter(self._inner)
        if self._deterministic:
            return iter(self._inner)
        # A custom sampler: draw its whole order under torch's RNG seeded the same way on
        # every replica, leaving the caller's RNG state untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return iter(list(self._inner))

    def __iter__(self):
        self.empty.clear()
        # Resuming mid-epoch: the batches already trained on are skipped as indices, never
        # loaded.
        for indices in itertools.islice(self._global_batches(), self._start_step, None):
            indices = list(indices)
            start, size = split_bounds(len(indices), self._num_replicas, self._replica_id)
            if size == 0 and indices:
                self.empty.append(True)
                yield indices[:1]
            else:
                self.empty.append(False)
                yield indices[start:start + size]

    def __len__(self):
        return len(self._inner)


def _is_shardable_loader(dataset):
    return (isinstance(dataset, DataLoader) and not isinstance(dataset.dataset, IterableDataset)
            and dataset.batch_sampler is not None)


def _sharded_loader(loader, batch_sampler):
    kwargs = dict(batch_sampler=batch_sampler, num_workers=loader.num_workers,
                  collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  multiprocessing_context=loader.multiprocessing_context,
                  generator=loader.generator, persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    # Batches must come back in the order their indices were drawn, for the empty-share
    # bookkeeping above (DataLoader's default).
    return DataLoader(loader.dataset, **kwargs)


class _InputBase:
    def __init__(self, strategy, options):
        ext = strategy.extended
        self._ext = ext
        self._options = options or InputOptions()
        if not isinstance(self._options, InputOptions):
            raise TypeError(f"options must be a ts.InputOptions, got {self._options!r}.")
        device = ext.torch_device
        self._device = device if self._options.experimental_fetch_to_device else None

    def _deliver(self, batch):
        if self._device is not None and self._device.type != "cpu":
            batch = nest.map_structure(
                lambda leaf: leaf.to(self._device, non_blocking=True)
                if isinstance(leaf, torch.Tensor) else leaf, batch)
        return self._ext.wrap(batch)


_END = object()


class DistributedDataset(_InputBase):
    """The result of ``strategy.experimental_distribute_dataset(dataset)`` (see the module
    docstring). Iterate it once per epoch; ``len()`` is the number of steps when the
    dataset has one. Creating it is a collective (replica 0 broadcasts the shuffling seed):
    every replica must create it at the same point.

    Raises:
      ValueError: a DataLoader that is already sharded by a DistributedSampler.
    """

    def __init__(self, strategy, dataset, options=None):
        super().__init__(strategy, options)
        ext = self._ext
        self._dataset = dataset
        self._epoch = 0
        self._start_step = 0
        self._num_replicas = ext.num_replicas_in_sync
        self._replica_id = ext.replica_id
        self._sampler = None
        self._loader = dataset
        if isinstance(dataset, DataLoader) and isinstance(dataset.sampler, DistributedSampler):
            raise ValueError(
                "experimental_distribute_dataset shards the global batches itself, but this "
                "DataLoader already uses a DistributedSampler. Pass a loader of global "
                "batches, or build per-replica loaders with "
                "strategy.distribute_datasets_from_function.")
        if self._num_replicas > 1 and _is_shardable_loader(dataset):
            seed = ext.communicator.broadcast_object(self._pick_seed(dataset))
            self._sampler = _ShardedBatchSampler(dataset.batch_sampler, self._num_replicas,
                                                 self._replica_id, seed)
            self._loader = _sharded_loader(dataset, self._sampler)

    @staticmethod
    def _pick_seed(loader):
        generator = getattr(loader.sampler, "generator", None) or loader.generator
        if generator is not None:
            return int(generator.initial_seed())
        # torch's seed (torch.manual_seed on replica 0 makes runs repeatable), read without
        # drawing from the RNG, so distributing a dataset changes no later random number.
        return int(torch.initial_seed())

    def set_epoch(self, epoch, start_step=0):
        """Sets the epoch the next iteration uses (for resuming); normally each iteration
        advances it by one. With `start_step` the next iteration starts at that step of the
        epoch: a sharded DataLoader skips the earlier batches' indices without loading them,
        any other iterable is iterated past them."""
        self._epoch = int(epoch)
        self._start_step = int(start_step)

    def state_dict(self):
        """The position to resume from: the next epoch and the shuffling seed."""
        return {"epoch": self._epoch,
                "seed": None if self._sampler is None else self._sampler._seed}

    def load_state_dict(self, state):
        """Restores `state_dict()`'s position (the same on every replica)."""
        self._epoch = int(state["epoch"])
        if self._sampler is not None and state.get("seed") is not None:
            self._sampler._seed = int(state["seed"])

    def __iter__(self):
        # The loader's iterator is made (and a resumed epoch's first steps skipped) here,
        # not at the first batch, so that a caller restoring random state (BackupAndRestore)
        # can do it between the iterator's set-up and the first batch, as it happened in
        # the run being resumed.
        epoch, start_step = self._epoch, self._start_step
        self._epoch += 1
        self._start_step = 0
        if self._sampler is not None:
            self._sampler.set_epoch(epoch, start_step)
            return self._sharded_batches(iter(self._loader))
        batches = iter(self._loader)
        for _ in range(start_step):
            if next(batches, _END) is _END:
                break
        return self._sliced_batches(batches)

    def _sharded_batches(self, batches):
        for batch in batches:
            if self._sampler.empty.popleft():
                batch = _empty_like_batch(batch)
            yield self._deliver(batch)

    def _sliced_batches(self, batches):
        for batch in batches:
            if self._num_replicas > 1:
                batch = _slice_batch(batch, self._num_replicas, self._replica_id)
            yield self._deliver(batch)

    def __len__(self):
        return len(self._dataset)


class DistributedDatasetsFromFunction(_InputBase):
    """The result of ``strategy.distribute_datasets_from_function(dataset_fn)``.

    `dataset_fn` receives an `InputContext` (``input_pipeline_id`` = this replica's id,
    ``num_input_pipelines`` = the number of replicas) and returns this replica's iterable of
    per-replica batches; it is responsible for sharding, e.g. with a
    ``DistributedSampler(num_replicas=ctx.num_input_pipelines, rank=ctx.input_pipeline_id)``.
    Every replica's pipeline must yield the same number of batches.
    """

    def __init__(self, strategy, dataset_fn, options=None):
        super().__init__(strategy, options)
        ext = self._ext
        self._context = InputContext(num_input_pipelines=ext.num_replicas_in_sync,
                                     input_pipeline_id=ext.replica_id,
                                     num_replicas_in_sync=ext.num_replicas_in_sync)
        self._dataset = dataset_fn(self._context)

    def __iter__(self):
        for batch in self._dataset:
            yield self._deliver(batch)

    def __len__(self):
        return len(self._dataset)
