"""Parameter-server training on torch.distributed.rpc (TensorFlow's ParameterServerStrategy
and ClusterCoordinator). See docs/parameter_server.md."""
from torchstrategy.parameter_server.coordinator import (ClosureCancelledError,
                                                        ClusterCoordinator, PerWorkerDataset,
                                                        PerWorkerIterator, PerWorkerValues,
                                                        RemoteValue)
from torchstrategy.parameter_server.local_cluster import LocalCluster, local_cluster
from torchstrategy.parameter_server.partitioners import (FixedShardsPartitioner,
                                                         MaxSizePartitioner,
                                                         MinSizePartitioner, Partitioner)
from torchstrategy.parameter_server.remote import ParameterServerUnavailableError
from torchstrategy.parameter_server.server import Server
from torchstrategy.parameter_server.strategy import ParameterServerStrategy
from torchstrategy.parameter_server.variables import (PSVariable, ShardedVariable,
                                                      embedding_lookup)

__all__ = [
    "ClosureCancelledError",
    "ClusterCoordinator",
    "FixedShardsPartitioner",
    "LocalCluster",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "PSVariable",
    "ParameterServerStrategy",
    "ParameterServerUnavailableError",
    "Partitioner",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "RemoteValue",
    "Server",
    "ShardedVariable",
    "embedding_lookup",
    "local_cluster",
]
