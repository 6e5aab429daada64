"""`InputContext`, `ValueContext` and `InputOptions`, as in tf.distribute."""
import dataclasses


class InputContext:
    """What ``dataset_fn`` needs to build one input pipeline
    (``distribute_datasets_from_function``).

    In torchstrategy's SPMD model each replica process runs its own pipeline, so
    ``num_input_pipelines`` is the number of replicas and ``input_pipeline_id`` is the
    replica id.
    """

    def __init__(self, num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size):
        """`global_batch_size` divided by the number of replicas.

        Raises:
          ValueError: if it does not divide evenly.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"The global batch size ({global_batch_size}) must be divisible "
                             f"by the number of replicas ({self.num_replicas_in_sync}).")
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self):
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
                f"input_pipeline_id={self.input_pipeline_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class ValueContext:
    """What ``value_fn`` receives in ``experimental_distribute_values_from_function``."""

    def __init__(self, replica_id_in_sync_group=0, num_replicas_in_sync=1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self):
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


@dataclasses.dataclass
class InputOptions:
    """Options for distributed input.

    Attributes:
      experimental_fetch_to_device: move each batch to the replica's device (default True);
        False leaves batches where the loader produced them.
    """

    experimental_fetch_to_device: bool = True
