"""`InputContext`, `ValueContext` and `InputOptions`, as in tf.distribute."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
from typing import Iterator


class InputContext:
    """What ``dataset_fn`` needs to build one input pipeline
    (``distribute_datasets_from_function``).

    In torchstrategy's SPMD model each replica process runs its own pipeline, so
    ``num_input_pipelines`` is the number of replicas and ``input_pipeline_id`` is the
    replica id. `pipeline_id_read` tells whether ``input_pipeline_id`` was read (a
    ``dataset_fn`` that never reads it cannot have sharded by it).
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1) -> None:
        self.num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync
        self.pipeline_id_read = False

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index in 0..num_input_pipelines-1."""
        self.pipeline_id_read = True
        return self._input_pipeline_id

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """`global_batch_size` divided by the number of replicas.

        Raises:
          ValueError: if it does not divide evenly.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"The global batch size ({global_batch_size}) must be divisible "
                             f"by the number of replicas ({self.num_replicas_in_sync}).")
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
                f"input_pipeline_id={self._input_pipeline_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class ValueContext:
    """What ``value_fn`` receives in ``experimental_distribute_values_from_function``."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1
                 ) -> None:
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class InputReplicationMode(enum.Enum):
    """How many input pipelines ``distribute_datasets_from_function`` builds
    (tf.distribute.InputReplicationMode).

    - ``PER_WORKER``: ``dataset_fn`` is called once per worker (process); the replicas of
      that process take turns drawing from it. The default.
    - ``PER_REPLICA``: ``dataset_fn`` is called once per replica, each replica drawing from
      its own pipeline. Supported by the strategies with one replica per process
      (MirroredStrategy, MultiWorkerMirroredStrategy), where a worker holds exactly one
      replica and both modes build the same pipelines; as in TensorFlow, refused by
      ``experimental_distribute_dataset`` and by the other strategies.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """Options for distributed input (tf.distribute.InputOptions), checked when created.

    Attributes:
      experimental_fetch_to_device: move each batch to the replica's device (default True);
        False leaves batches where the loader produced them. Must be False when the
        dataset is placed on the device (as in TensorFlow).
      experimental_replication_mode: an `InputReplicationMode` (default ``PER_WORKER``).
      experimental_place_dataset_on_device: build the replica's pipeline under its device
        (``dataset_fn`` runs inside ``torch.device(replica device)``, so tensors it creates
        are already there); only with ``PER_REPLICA`` and
        ``experimental_fetch_to_device=False``, as in TensorFlow. Default False.
      experimental_per_replica_buffer_size: how many batches are copied to a replica's
        accelerator ahead of the step that uses them (default 1; 0 copies each batch when
        it is taken). On a CPU replica the batches are already in the memory the step
        reads, so there is no copy to start early and the value has no effect.

    Raises:
      TypeError / ValueError: an option of the wrong type or value, or a combination that
        TensorFlow refuses (named in the message).
    """

    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self) -> None:
        for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"InputOptions({name}={getattr(self, name)!r}): must be True "
                                "or False.")
        mode = self.experimental_replication_mode
        if not isinstance(mode, InputReplicationMode):
            raise TypeError(f"InputOptions(experimental_replication_mode={mode!r}): must be "
                            "ts.InputReplicationMode.PER_WORKER or PER_REPLICA.")
        size = self.experimental_per_replica_buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"InputOptions(experimental_per_replica_buffer_size={size!r}): "
                             "must be an int >= 0 (0 disables prefetching to the device).")
        if self.experimental_place_dataset_on_device:
            if mode is not InputReplicationMode.PER_REPLICA:
                raise ValueError(
                    "InputOptions(experimental_place_dataset_on_device=True) can only be used "
                    "with experimental_replication_mode=ts.InputReplicationMode.PER_REPLICA "
                    "(as in TensorFlow).")
            if self.experimental_fetch_to_device:
                raise ValueError(
                    "InputOptions(experimental_place_dataset_on_device=True) requires "
                    "experimental_fetch_to_device=False: the dataset already produces its "
                    "batches on the device (as in TensorFlow).")


def check_input_options(options: InputOptions | None, *, from_function: bool,
                        per_replica_supported: bool, where: str) -> InputOptions:
    """`options` (None: the defaults) as an `InputOptions`, refused where `where` (a
    strategy's name) cannot honour it.

    ``PER_REPLICA`` replication is honoured only by ``distribute_datasets_from_function``
    (`from_function`) of a strategy with one replica per process (`per_replica_supported`),
    as TensorFlow honours it only there (MirroredStrategy's).

    Raises:
      TypeError: `options` is not an `InputOptions`.
      NotImplementedError: ``PER_REPLICA`` where it is not supported.
    """
    options = InputOptions() if options is None else options
    if not isinstance(options, InputOptions):
        raise TypeError(f"options must be a ts.InputOptions, got {options!r}.")
    if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
        if not from_function:
            raise NotImplementedError(
                "InputReplicationMode.PER_REPLICA is only supported by "
                "distribute_datasets_from_function, not experimental_distribute_dataset "
                "(as in TensorFlow). Use distribute_datasets_from_function, or PER_WORKER.")
        if not per_replica_supported:
            raise NotImplementedError(
                f"InputReplicationMode.PER_REPLICA is not supported by {where}: as in "
                "TensorFlow, only MirroredStrategy (and MultiWorkerMirroredStrategy, one "
                "replica per process) build one pipeline per replica. Use PER_WORKER.")
    return options


# torch's words when BatchNorm in training mode gets one value per channel.
_ONE_VALUE_PER_CHANNEL = "Expected more than 1 value per channel when training"


@contextlib.contextmanager
def explained_small_local_batches(num_replicas: int) -> Iterator[None]:
    """Re-raises torch's "Expected more than 1 value per channel when training" (BatchNorm
    given one example) raised in a replica's step, when there are several replicas, as a
    ValueError saying why it happens only once the batch is split (the last, smaller
    global batch leaves this replica one example) and how to avoid it; torch's error is
    kept as the cause."""
    try:
        yield
    except ValueError as error:
        if num_replicas < 2 or _ONE_VALUE_PER_CHANNEL not in str(error):
            raise
        size = re.search(r"input size (.*)$", str(error).splitlines()[0])
        raise ValueError(
            f"torchstrategy: BatchNorm in training mode got one example on this replica "
            f"(input size {size.group(1) if size else '?'}): its share of a global batch "
            f"split over {num_replicas} replicas. This happens with the last, smaller "
            f"global batch (fewer than {2 * num_replicas} examples leave some replica one "
            "or none), while one device normalises that whole batch. Drop the last partial "
            "batch (DataLoader(..., drop_last=True) / dataset.batch(..., "
            "drop_remainder=True), or a dataset length divisible by the global batch), or "
            "give every replica at least two examples of every batch.") from error
