"""`Capabilities`: what the library may ask of a strategy, as one frozen record.

Every question the library asks about a strategy's nature (can a loop that runs once per
process drive it, are its replicas threads, does it trace the global batch, are its
parameters sharded, do its checkpoints need converting) is answered here and nowhere else:
a strategy class states its record once (``Strategy.CAPABILITIES``), before any instance
exists, so the table of Trainer names (`torchstrategy.strategies.registry`) reads the same
answer the Lightning adapter reads from a built strategy (``extended.capabilities``).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """A strategy's answers to the questions the library asks of it.

    Attributes:
      one_replica_per_process: every process of the job runs exactly one replica, with its
        own copy of the program (the default strategy, OneDeviceStrategy, the mirrored and
        sharded strategies): a training loop that runs once per process (Lightning's) can
        drive the strategy. False where one process runs several replicas (threads, one
        XLA program) or the replicas run closures (parameter servers).
      replicas_are_threads: this process runs its replicas as threads sharing the user's
        objects (CentralStorageStrategy): a shared object updated inside ``run`` (a
        metric) is updated by several threads at once.
      traces_global_batch: ``run`` traces the whole global batch at once (TPUStrategy):
        loss scaling then divides by the global batch without multiplying by the replica
        count.
      shards_parameters: each replica holds only a shard of the parameters created in
        scope (ShardedStrategy).
      converts_checkpoint_state: ``extended.state_dict_for_checkpoint`` /
        ``load_state_dict_from_checkpoint`` do more than ``state_dict()`` /
        ``load_state_dict()`` (gather shards, merge a partitioned optimizer state): a
        checkpoint writer with a path of its own for plain state (Lightning's) must go
        through them. Implied by `shards_parameters`.

    Raises:
      ValueError: `shards_parameters` without `converts_checkpoint_state`, or
        `replicas_are_threads` with `one_replica_per_process` (contradictions).
    """

    one_replica_per_process: bool = True
    replicas_are_threads: bool = False
    traces_global_batch: bool = False
    shards_parameters: bool = False
    converts_checkpoint_state: bool = False

    def __post_init__(self) -> None:
        if self.shards_parameters and not self.converts_checkpoint_state:
            raise ValueError("Capabilities(shards_parameters=True) needs "
                             "converts_checkpoint_state=True: a sharded parameter's "
                             "state_dict() holds this replica's shard only.")
        if self.replicas_are_threads and self.one_replica_per_process:
            raise ValueError("Capabilities(replicas_are_threads=True) runs several replicas "
                             "in one process: pass one_replica_per_process=False.")
