"""torchstrategy: TensorFlow's tf.distribute.Strategy programming model for PyTorch.

    import torchstrategy as ts

    strategy = ts.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = Net()
        optimizer = torch.optim.Adam(model.parameters())
    for batch in strategy.experimental_distribute_dataset(loader):
        loss = strategy.run(train_step, args=(batch,))

This module only re-exports the public surface; see the submodules for the details.
"""
import importlib

from torchstrategy import checkpoint, cluster_resolver
from torchstrategy.cluster_resolver import (ClusterResolver, ClusterSpec, SimpleClusterResolver,
                                           TFConfigClusterResolver,
                                           TorchElasticClusterResolver, TPUClusterResolver,
                                           UnionResolver)
from torchstrategy.cluster_resolver import KubernetesClusterResolver, SlurmClusterResolver
from torchstrategy import metrics, mixed_precision
from torchstrategy.backup_and_restore import BackupAndRestore
from torchstrategy.fault_tolerance import PreemptionCheckpointHandler, TerminationConfig
from torchstrategy.fault_tolerance.live_recovery import LiveRecovery
from torchstrategy.collectives.communicator import CollectiveError
from torchstrategy.collectives.hierarchical import HierarchicalCopyAllReduce
from torchstrategy.communication_options import (CommunicationImplementation,
                                                 CommunicationOptions)
from torchstrategy.collectives.cross_device_ops import (CrossDeviceOps, NcclAllReduce,
                                                        ReductionToOneDevice)
from torchstrategy.collectives.compression import AutoCompression, Int8, OneBitAdam, PowerSGD
from torchstrategy.collectives.autotune import AutotuneResult, BucketAutotuner
from torchstrategy.context import (experimental_set_strategy, get_cross_replica_context,
                                   get_replica_context, get_strategy, has_strategy,
                                   in_cross_replica_context)
from torchstrategy.input.contexts import (InputContext, InputOptions, InputReplicationMode,
                                          ValueContext)
from torchstrategy.launch.spawn import launch
from torchstrategy.accumulation import accumulate
from torchstrategy.onebit_adamw import OneBitAdamW
from torchstrategy.losses import (compute_average_loss, scale_mean_loss,
                                  scale_regularization_loss)
from torchstrategy.reduce_op import ReduceOp
from torchstrategy.replica_context import ReplicaContext
from torchstrategy.run_options import RunOptions
from torchstrategy.strategies.base import Strategy, StrategyExtended
from torchstrategy.strategies import default as _default_strategy  # registers itself
from torchstrategy.strategies.central_storage import CentralStorageStrategy
from torchstrategy.strategies.mirrored import MirroredStrategy
from torchstrategy.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from torchstrategy.strategies.one_device import OneDeviceStrategy
from torchstrategy.strategies.sharding.training import clip_grad_norm_
from torchstrategy.strategies.tpu import TPUStrategy  # imports torch_xla only when made
from torchstrategy.values import DistributedValues, Mirrored, PerReplica
from torchstrategy.variables import (MirroredVariable, SyncOnReadVariable, Variable,
                                     VariableAggregation, VariableSynchronization)
from torchstrategy import values
from torchstrategy import parameter_server
from torchstrategy.parameter_server import ClusterCoordinator, ParameterServerStrategy, Server
# Lightning-free bases: constructing one imports Lightning (`torchstrategy.lightning`).
from torchstrategy.lightning_base.adapter import LightningStrategy
from torchstrategy.lightning_base.backup import BackupAndRestoreCallback

__version__ = "0.1.0"

# Imported when first used: ShardedStrategy needs torch's FSDP2 and DTensor, which take
# longer to import than the rest of torchstrategy (every replica process pays for it);
# load_pretrained needs DTensor and torch.distributed.checkpoint.
_LAZY = {"ShardedStrategy": "torchstrategy.strategies.sharded",
         "load_pretrained": "torchstrategy.strategies.sharding.pretrained"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchstrategy' has no attribute {name!r}")

__all__ = [  # one name a line, sorted: adding a name touches one line
    "AutoCompression",
    "AutotuneResult",
    "BackupAndRestore",
    "BackupAndRestoreCallback",
    "BucketAutotuner",
    "CentralStorageStrategy",
    "ClusterCoordinator",
    "ClusterResolver",
    "ClusterSpec",
    "CollectiveError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DistributedValues",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "Int8",
    "KubernetesClusterResolver",
    "LightningStrategy",
    "LiveRecovery",
    "Mirrored",
    "MirroredStrategy",
    "MirroredVariable",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneBitAdam",
    "OneBitAdamW",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "PowerSGD",
    "PreemptionCheckpointHandler",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "Server",
    "ShardedStrategy",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "Strategy",
    "StrategyExtended",
    "SyncOnReadVariable",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "TPUStrategy",
    "TerminationConfig",
    "TorchElasticClusterResolver",
    "UnionResolver",
    "ValueContext",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "accumulate",
    "checkpoint",
    "clip_grad_norm_",
    "cluster_resolver",
    "compute_average_loss",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "launch",
    "load_pretrained",
    "metrics",
    "mixed_precision",
    "parameter_server",
    "scale_mean_loss",
    "scale_regularization_loss",
    "values",
]

