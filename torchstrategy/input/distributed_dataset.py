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
- Shuffling: the global batches are the ones the loader itself gives, used alone, on
  replica 0, whatever the number of replicas, epoch after epoch. Every replica iterates the
  loader's own batch sampler; at the start of each epoch the random state it draws from
  (the loader's and its sampler's generators, or torch's global generator when they have
  none) is replica 0's, so N replicas see the global batches one device would.
- Batches arrive on the replica's device, with tensor leaves wrapped as `PerReplica`.

Iterating gives a `DistributedIterator`: ``next()`` / ``get_next()``,
``get_next_as_optional()`` (the end of data agreed by every replica, as TensorFlow loops
detect it) and ``element_spec``; ``dataset.reduce(initial_state, reduce_fn)`` folds every
step.
"""
from __future__ import annotations

import abc
import collections
import collections.abc
import itertools
import warnings
from typing import Any, Callable, Iterable, Iterator, TypeGuard, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from torchstrategy import nest
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.context import AnyStrategy
from torchstrategy.input.contexts import InputContext, InputOptions, check_input_options

_T = TypeVar("_T")


def split_bounds(total: int, num_replicas: int, replica_id: int) -> tuple[int, int]:
    """(start, size) of replica `replica_id`'s share of `total` rows: an even split, the
    first ``total % num_replicas`` replicas taking one row more."""
    base, extra = divmod(total, num_replicas)
    start = replica_id * base + min(replica_id, extra)
    return start, base + (1 if replica_id < extra else 0)


def _slice_batch(batch: Any, num_replicas: int, replica_id: int) -> Any:
    def take(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            start, size = split_bounds(leaf.shape[0], num_replicas, replica_id)
            return leaf[start:start + size]
        return leaf
    return nest.map_structure(take, batch)


def _empty_like_batch(batch: Any) -> Any:
    return nest.map_structure(
        lambda leaf: leaf[:0] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf,
        batch)


class _ShardedBatchSampler(Sampler[list[int]]):
    """Yields, for each global batch of the loader's own `batch_sampler`, only this
    replica's indices.

    The loader's batch sampler itself is iterated (never a copy), once per epoch, so its
    sampler and generators advance exactly as when the loader is used alone. An empty share
    is fetched as one sample of the global batch (so collation sees a real sample) and
    recorded in `empty`, for the dataset to cut to zero rows.
    """

    def __init__(self, batch_sampler: Iterable[list[int]], num_replicas: int,
                 replica_id: int) -> None:
        self._inner = batch_sampler
        self._num_replicas = num_replicas
        self._replica_id = replica_id
        self._start_step = 0
        self._batches: list[list[int]] | None = None
        self.empty: collections.deque[bool] = collections.deque()

    def begin_epoch(self, start_step: int) -> None:
        """The next iteration draws a new epoch and skips its first `start_step` global
        batches."""
        self._start_step = start_step
        self._batches = None

    def global_batches(self) -> list[list[int]]:
        """This epoch's global batches, drawn from the loader's batch sampler all at once,
        the first time they are asked for (so that every random number the epoch's order
        takes is drawn when the iterator is set up)."""
        if self._batches is None:
            self._batches = [list(indices) for indices in self._inner]
        return self._batches

    def __iter__(self) -> Iterator[list[int]]:
        self.empty.clear()
        # Resuming mid-epoch: the batches already trained on are skipped as indices, never
        # loaded.
        for indices in itertools.islice(self.global_batches(), self._start_step, None):
            start, size = split_bounds(len(indices), self._num_replicas, self._replica_id)
            if size == 0 and indices:
                self.empty.append(True)
                yield indices[:1]
            else:
                self.empty.append(False)
                yield indices[start:start + size]

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]  # a DataLoader's batch sampler has one


def _is_shardable_loader(dataset: Any) -> TypeGuard[DataLoader]:
    return (isinstance(dataset, DataLoader) and not isinstance(dataset.dataset, IterableDataset)
            and dataset.batch_sampler is not None)


def _sharded_loader(loader: DataLoader, batch_sampler: _ShardedBatchSampler) -> DataLoader:
    # The loader's own generator: creating an iterator draws the workers' base seed from it
    # before the sampler draws the order, as with the loader alone.
    kwargs: dict[str, Any] = dict(batch_sampler=batch_sampler, num_workers=loader.num_workers,
                  collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                  timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                  multiprocessing_context=loader.multiprocessing_context,
                  generator=loader.generator, persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    # Batches must come back in the order their indices were drawn, for the empty-share
    # bookkeeping above (DataLoader's default).
    return DataLoader(loader.dataset, **kwargs)


def loader_generators(loader: DataLoader) -> list[torch.Generator]:
    """The distinct torch.Generators a DataLoader draws from (its own, its sampler's)."""
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    generators = [loader.generator, getattr(sampler, "generator", None)]
    return [g for i, g in enumerate(generators)
            if g is not None and all(g is not h for h in generators[:i])]


class ShardedLoader:
    """A DataLoader over a map-style dataset, read by `num_replicas` processes that each load
    only their share of every global batch, the global batches being those the loader gives
    on replica 0 when used alone.

    Each epoch (`batches`) starts with one broadcast of replica 0's random state that the
    loader draws from: the states of the loader's and its sampler's generators (set on the
    other replicas' generators, so they advance alike) and, when either has none, torch's
    global generator, which the other replicas borrow only to draw the epoch's order (their
    own global random state is left as it was). A loader whose sampler is sequential draws
    no order, and nothing is broadcast.
    """

    def __init__(self, loader: DataLoader, num_replicas: int, replica_id: int,
                 communicator: Communicator) -> None:
        if loader.batch_sampler is None:
            raise ValueError("A sharded DataLoader needs a batch sampler (a batch_size).")
        self._comm = communicator
        self._replica_id = replica_id
        self._sampler = _ShardedBatchSampler(loader.batch_sampler, num_replicas, replica_id)
        self._loader = _sharded_loader(loader, self._sampler)
        sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
        self._random = not isinstance(sampler, SequentialSampler)
        self._generators = loader_generators(loader)
        # The workers' base seed comes from torch's generator when the loader has none; a
        # sampler without a generator attribute (a custom one) may draw from it too.
        self._global = loader.generator is None or getattr(sampler, "generator", None) is None
        self._epoch_start: list[torch.Tensor] = []
        self._in_epoch = False

    def _align_random_state(self) -> torch.Tensor | None:
        if not self._random:
            return None
        mine = {"generators": [g.get_state() for g in self._generators],
                "torch": torch.get_rng_state() if self._global else None}
        chief = self._comm.broadcast_object(mine)
        if self._replica_id == 0:
            return None
        for generator, state in zip(self._generators, chief["generators"]):
            generator.set_state(state)
        return chief["torch"]

    def batches(self, start_step: int = 0) -> Iterator[Any]:
        """This replica's batches of one epoch, skipping the first `start_step` global
        batches without loading them; an empty share arrives with zero rows. A collective:
        every replica starts each epoch at the same point."""
        borrowed = self._align_random_state()
        self._epoch_start = [g.get_state() for g in self._generators]
        self._in_epoch = True
        self._sampler.begin_epoch(start_step)
        # The epoch's order is drawn here, when the iterator is set up, not at the first
        # batch (BackupAndRestore restores the random state between the two).
        if borrowed is None:
            loaded = iter(self._loader)           # the workers' base seed
            self._sampler.global_batches()        # the epoch's order
        else:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(borrowed)
                loaded = iter(self._loader)
                self._sampler.global_batches()
        return self._cut_empty(loaded)

    def _cut_empty(self, loaded: Iterator[Any]) -> Iterator[Any]:
        for batch in loaded:
            if self._sampler.empty.popleft():
                batch = _empty_like_batch(batch)
            yield batch
        self._in_epoch = False

    def state_dict(self) -> list[torch.Tensor]:
        """The generators' states an epoch resumed now must start from: those at the start
        of the epoch in progress, or the current ones between epochs."""
        if self._in_epoch:
            return list(self._epoch_start)
        return [g.get_state() for g in self._generators]

    def load_state_dict(self, states: Iterable[torch.Tensor]) -> None:
        """Sets the loader's generators to `states` (from `state_dict`)."""
        for generator, state in zip(self._generators, states):
            generator.set_state(state)


class TensorSpec(collections.namedtuple("TensorSpec", ["shape", "dtype"])):
    """The shape and dtype of a tensor a replica receives (``element_spec``'s leaves);
    ``shape[0]`` is None: the rows of a replica's slice vary (a short last batch)."""


class OptionalValue:
    """The result of ``get_next_as_optional()`` (TensorFlow's ``tf.experimental.Optional``):
    ``has_value()`` and ``get_value()``."""

    def __init__(self, value: Any = None, has_value: bool = False) -> None:
        self._value = value
        self._has_value = has_value

    def has_value(self) -> bool:
        """True when the step exists on every replica."""
        return self._has_value

    def get_value(self) -> Any:
        """The step's distributed batch.

        Raises:
          ValueError: no value (the data has ended on some replica).
        """
        if not self._has_value:
            raise ValueError("This optional has no value: the input ended on at least one "
                             "replica. Check has_value() first.")
        return self._value

    def __repr__(self) -> str:
        return f"OptionalValue(has_value={self._has_value})"


class DistributedIterator:
    """An iterator over a distributed dataset's steps (tf.distribute.DistributedIterator).

    ``next(it)`` and ``get_next()`` give this replica's next step and raise
    ``StopIteration`` when its input has ended (TensorFlow raises ``OutOfRangeError``).
    ``get_next_as_optional()`` returns an `OptionalValue` that has a value on every replica
    or on none: when any replica's input has ended, no replica gets the step (a collective;
    every replica calls it at the same point). ``element_spec`` reads the first step ahead
    (kept for the next call) and describes it.
    """

    def __init__(self, steps: Iterator[Any], agree: Callable[[bool], bool]) -> None:
        self._steps = steps
        self._agree = agree
        self._peeked: list[Any] = []

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._peeked:
            return self._peeked.pop()
        return next(self._steps)

    def get_next(self) -> Any:
        """This replica's next step.

        Raises:
          StopIteration: the input has ended.
        """
        return next(self)

    def get_next_as_optional(self) -> OptionalValue:
        """The next step as an `OptionalValue`, with a value on every replica or on none."""
        step = next(self, _END)
        if not self._agree(step is not _END):
            return OptionalValue()
        return OptionalValue(step, True)

    @property
    def element_spec(self) -> Any:
        """The structure of a step with each tensor a `TensorSpec` (this replica's
        component: rows None, the other dims and the dtype as received) and other leaves
        unchanged; None when the input is empty. Reads the first step ahead."""
        if not self._peeked:
            step = next(self._steps, _END)
            if step is _END:
                return None
            self._peeked.append(step)
        return nest.map_structure(_spec_of, self._peeked[0])


def _specs_of(step: Any) -> Any:
    return None if step is None else nest.map_structure(_spec_of, step)


def _spec_of(leaf: Any) -> Any:
    components = getattr(leaf, "values", None)
    if isinstance(components, tuple) and components:
        leaf = components[0]
    if isinstance(leaf, torch.Tensor):
        shape = tuple(leaf.shape)
        return TensorSpec((None,) + shape[1:] if shape else (), leaf.dtype)
    return leaf


def lookahead(items: Iterable[_T], depth: int) -> Iterator[_T]:
    """Yields `items` in order, drawing up to `depth` items ahead of the one yielded (so
    that their copies to a device overlap the step using the current one)."""
    buffer: collections.deque[_T] = collections.deque()
    for item in items:
        buffer.append(item)
        if len(buffer) > depth:
            yield buffer.popleft()
    while buffer:
        yield buffer.popleft()


class ReducibleInput(abc.ABC):
    """What every distributed input has: ``reduce(initial_state, reduce_fn)`` over its
    steps and ``element_spec``. Subclasses keep the iterable they draw batches from in
    `_dataset` and iterate it through `_draw()`."""

    _dataset: Iterable[Any]
    # A first batch that element_spec read ahead from a one-shot iterator, for the next
    # iteration; and element_spec once known.
    _held: list[Any] | None = None
    _spec: tuple[Any] | None = None

    @abc.abstractmethod
    def __iter__(self) -> DistributedIterator:
        """A new iterator over this input's steps (each subclass draws its own way)."""

    @property
    def element_spec(self) -> Any:
        """The structure of one replica's element, each tensor a `TensorSpec` (rows None,
        the other dims and the dtype as the data gives them) and other leaves unchanged, as
        the iterator's ``element_spec`` gives it; None when the input is empty
        (tf.distribute's ``DistributedDataset.element_spec``).

        Known without a step: the first batch of the data is read ahead once, with torch's
        random state and the loader's generators put back afterwards, so iterating
        afterwards gives the batches it would have given (a one-shot iterator's batch is
        kept and given back first). No collective is run.
        """
        if self._spec is None:
            self._spec = (_specs_of(self._peek()),)
        return self._spec[0]

    def _peek(self) -> Any:
        if isinstance(self._dataset, collections.abc.Iterator):
            if not self._held:
                first = next(self._dataset, _END)
                if first is _END:
                    return None
                self._held = [first]
            return self._held[0]
        generators = loader_generators(self._dataset) \
            if isinstance(self._dataset, DataLoader) else []
        saved = [g.get_state() for g in generators]
        with torch.random.fork_rng(devices=[]):
            first = next(iter(self._dataset), _END)
        for generator, state in zip(generators, saved):
            generator.set_state(state)
        return None if first is _END else first

    def _draw(self) -> Iterator[Any]:
        """An iterator over `_dataset`, giving back first the batch `element_spec` read
        ahead from a one-shot iterator."""
        held, self._held = self._held, None
        return itertools.chain(held, self._dataset) if held else iter(self._dataset)

    def reduce(self, initial_state: Any, reduce_fn: Callable[[Any, Any], Any]) -> Any:
        """Folds every step into a state: ``state = reduce_fn(state, step)`` from
        `initial_state`, in cross-replica context (use ``strategy.reduce`` in `reduce_fn`
        for a value over every replica), until the input ends on some replica
        (``get_next_as_optional``). Returns the final state."""
        iterator = iter(self)
        state = initial_state
        while True:
            step = iterator.get_next_as_optional()
            if not step.has_value():
                return state
            state = reduce_fn(state, step.get_value())


class _InputBase(ReducibleInput):
    def __init__(self, strategy: AnyStrategy, options: InputOptions | None,
                 from_function: bool) -> None:
        ext = strategy.extended
        self._ext = ext
        self._options = check_input_options(options, from_function=from_function,
                                            per_replica_supported=True,
                                            where=type(strategy).__name__)
        device = ext.torch_device
        self._device = device if self._options.experimental_fetch_to_device else None
        accelerator = device is not None and device.type != "cpu"
        self._depth = self._options.experimental_per_replica_buffer_size if accelerator else 0

    def _deliver(self, batch: Any) -> Any:
        if self._device is not None and self._device.type != "cpu":
            batch = nest.map_structure(
                lambda leaf: leaf.to(self._device, non_blocking=True)
                if isinstance(leaf, torch.Tensor) else leaf, batch)
        return self._ext.wrap(batch)

    def _iterator(self, batches: Iterator[Any]) -> DistributedIterator:
        delivered = (self._deliver(batch) for batch in batches)
        return DistributedIterator(lookahead(delivered, self._depth), self._all_have)

    def _all_have(self, have: bool) -> bool:
        comm = self._ext.communicator
        if comm.world_size == 1:
            return have
        flag = torch.tensor([int(have)], dtype=torch.int64, device=comm.device)
        # One int64 made here on every replica: no layout to compare first (a step of a
        # TF-style loop would pay a second round trip).
        (count,) = comm.all_reduce([flag], "SUM", check_layout=False)
        return int(count.item()) == comm.world_size


_END = object()


class DistributedDataset(_InputBase):
    """The result of ``strategy.experimental_distribute_dataset(dataset)`` (see the module
    docstring). Iterate it once per epoch (a `DistributedIterator`); ``len()`` is the number
    of steps when the dataset has one. With several replicas, each epoch of a DataLoader
    over a map-style dataset starts with a collective (replica 0's random state, see
    `ShardedLoader`): every replica iterates it at the same point.

    Raises:
      ValueError: a DataLoader that is already sharded by a DistributedSampler.
      NotImplementedError: ``InputReplicationMode.PER_REPLICA`` (only for
        ``distribute_datasets_from_function``, as in TensorFlow).
    """

    def __init__(self, strategy: AnyStrategy, dataset: Iterable[Any],
                 options: InputOptions | None = None) -> None:
        super().__init__(strategy, options, from_function=False)
        ext = self._ext
        self._dataset = dataset
        self._epoch = 0
        self._start_step = 0
        self._num_replicas = ext.num_replicas_in_sync
        self._replica_id = ext.replica_id
        self._sharded: ShardedLoader | None = None
        # Without sharding, the generators of a DataLoader used as it is (for state_dict).
        self._generators = loader_generators(dataset) if isinstance(dataset, DataLoader) else []
        self._epoch_start: list[torch.Tensor] = []
        self._in_epoch = False
        if isinstance(dataset, DataLoader) and isinstance(dataset.sampler, DistributedSampler):
            raise ValueError(
                "experimental_distribute_dataset shards the global batches itself, but this "
                "DataLoader already uses a DistributedSampler. Pass a loader of global "
                "batches, or build per-replica loaders with "
                "strategy.distribute_datasets_from_function.")
        if self._num_replicas > 1 and _is_shardable_loader(dataset):
            self._sharded = ShardedLoader(dataset, self._num_replicas, self._replica_id,
                                          ext.communicator)

    @property
    def dataset(self) -> Iterable[Any]:
        """The iterable of global batches this distributes, as it was given."""
        return self._dataset

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Sets the epoch the next iteration uses (for resuming); normally each iteration
        advances it by one. With `start_step` the next iteration starts at that step of the
        epoch: a sharded DataLoader skips the earlier batches' indices without loading them,
        any other iterable is iterated past them. The order of an epoch is the one the
        loader's random state gives when it starts (restore it, or `load_state_dict`)."""
        self._epoch = int(epoch)
        self._start_step = int(start_step)

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from: the next epoch, and the states of the loader's
        generators (a DataLoader's) that the epoch in progress started from, or their
        current states between epochs."""
        if self._sharded is not None:
            generators = self._sharded.state_dict()
        elif self._in_epoch:
            generators = list(self._epoch_start)
        else:
            generators = [g.get_state() for g in self._generators]
        return {"epoch": self._epoch, "generators": generators}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores `state_dict()`'s position (the same on every replica)."""
        self._epoch = int(state["epoch"])
        states = state.get("generators")
        if states is not None and self._sharded is not None:
            self._sharded.load_state_dict(states)
        elif states is not None:
            for generator, saved in zip(self._generators, states):
                generator.set_state(saved)

    def __iter__(self) -> DistributedIterator:
        # The loader's iterator is made (and a resumed epoch's first steps skipped) here,
        # not at the first batch, so that a caller restoring random state (BackupAndRestore)
        # can do it between the iterator's set-up and the first batch, as it happened in
        # the run being resumed.
        start_step = self._start_step
        self._epoch += 1
        self._start_step = 0
        if self._sharded is not None:
            return self._iterator(self._sharded.batches(start_step))
        self._epoch_start = [g.get_state() for g in self._generators]
        self._in_epoch = True
        batches = self._draw()
        for _ in range(start_step):
            if next(batches, _END) is _END:
                break
        return self._iterator(self._sliced_batches(batches))

    def _sliced_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            if self._num_replicas > 1:
                batch = _slice_batch(batch, self._num_replicas, self._replica_id)
            yield batch
        self._in_epoch = False

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]  # TypeError if it has none


def _sharded_by_sampler(dataset: Any, num_pipelines: int) -> bool:
    if not isinstance(dataset, DataLoader):
        return False
    sampler = getattr(dataset.batch_sampler, "sampler", dataset.sampler)
    return isinstance(sampler, DistributedSampler) and sampler.num_replicas == num_pipelines


def warn_if_pipelines_may_repeat(context: InputContext, dataset: Any) -> None:
    """Warns (a UserWarning, shown once per place by Python's filters) when several
    replica processes each built a pipeline with a ``dataset_fn`` that never read
    ``context.input_pipeline_id`` and did not return a DataLoader sharded by a
    ``DistributedSampler`` over the pipelines: every replica would then read the same
    batches. Deciding it for sure would need a collective over the data, so this is the
    cheap check; a pipeline that shards itself otherwise reads the id to say so."""
    n = context.num_input_pipelines
    if n <= 1 or context.pipeline_id_read or _sharded_by_sampler(dataset, n):
        return
    warnings.warn(
        f"distribute_datasets_from_function: dataset_fn never read its InputContext's "
        f"input_pipeline_id, and each of the {n} replica processes builds its own "
        "pipeline, so every replica may train on the same batches. Shard by the context, "
        "e.g. DistributedSampler(ds, num_replicas=ctx.num_input_pipelines, "
        "rank=ctx.input_pipeline_id), or use experimental_distribute_dataset for global "
        "batches. If the pipeline already differs per replica, read ctx.input_pipeline_id "
        "in dataset_fn to say so.", UserWarning, stacklevel=5)


class DistributedDatasetsFromFunction(_InputBase):
    """The result of ``strategy.distribute_datasets_from_function(dataset_fn)``.

    `dataset_fn` receives an `InputContext` (``input_pipeline_id`` = this replica's id,
    ``num_input_pipelines`` = the number of replicas) and returns this replica's iterable of
    per-replica batches; it is responsible for sharding, e.g. with a
    ``DistributedSampler(num_replicas=ctx.num_input_pipelines, rank=ctx.input_pipeline_id)``.
    With one replica per process, a worker's pipeline is its replica's: ``PER_WORKER`` and
    ``PER_REPLICA`` replication build the same pipelines. With
    ``experimental_place_dataset_on_device`` `dataset_fn` runs under the replica's device
    (tensors it creates are made there). Pipelines of different lengths: iterate with
    ``get_next_as_optional`` (or ``reduce``), which stops every replica at the shortest.
    """

    def __init__(self, strategy: AnyStrategy,
                 dataset_fn: Callable[[InputContext], Iterable[Any]],
                 options: InputOptions | None = None) -> None:
        super().__init__(strategy, options, from_function=True)
        ext = self._ext
        self._context = InputContext(num_input_pipelines=ext.num_replicas_in_sync,
                                     input_pipeline_id=ext.replica_id,
                                     num_replicas_in_sync=ext.num_replicas_in_sync)
        if self._options.experimental_place_dataset_on_device:
            with torch.device(ext.torch_device or "cpu"):
                self._dataset = dataset_fn(self._context)
        else:
            self._dataset = dataset_fn(self._context)
        warn_if_pipelines_may_repeat(self._context, self._dataset)

    def __iter__(self) -> DistributedIterator:
        return self._iterator(self._draw())

    def __len__(self) -> int:
        return len(self._dataset)  # type: ignore[arg-type]  # TypeError if it has none
