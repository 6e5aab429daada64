"""The strategy's nature is one record (`Capabilities`) and its parameter handling one
component (`ParameterHandling`): the Trainer's table reads the record, the data-parallel
extended cannot be subclassed to switch something off, a handling serves one strategy, and
what a handling adds to ``extended`` is named when a name is wrong. One process, no
replicas launched."""
import pytest
import torch

import torchstrategy as ts
from torchstrategy.collectives.communicator import Communicator
from torchstrategy.strategies import registry
from torchstrategy.strategies.capabilities import Capabilities
from torchstrategy.strategies.data_parallel import DataParallelExtended
from torchstrategy.strategies.parameters import MirroredParameters


def test_contradictory_capabilities_are_refused():
    with pytest.raises(ValueError, match="needs converts_checkpoint_state=True"):
        Capabilities(shards_parameters=True)
    with pytest.raises(ValueError, match="pass one_replica_per_process=False"):
        Capabilities(replicas_are_threads=True)


def test_the_trainer_table_reads_the_classes_record():
    under_a_trainer = {kind.kind for kind in registry.KINDS
                       if kind.strategy_class().CAPABILITIES.one_replica_per_process}
    assert set(registry.kinds_under_a_trainer()) == under_a_trainer == {
        "mirrored", "multi_worker_mirrored", "one_device", "sharded"}
    assert ts.CentralStorageStrategy.CAPABILITIES.replicas_are_threads
    assert ts.TPUStrategy.CAPABILITIES.traces_global_batch


def test_a_built_strategy_answers_with_its_class_record():
    strategy = ts.OneDeviceStrategy("cpu")
    ext = strategy.extended
    assert ext.capabilities is ts.OneDeviceStrategy.CAPABILITIES
    assert (ext.one_replica_per_process, ext.replicas_are_threads, ext.traces_global_batch,
            ext.shards_parameters, ext.converts_checkpoint_state) == (
        True, False, False, False, False)
    central = ts.CentralStorageStrategy(compute_devices=["cpu"])
    assert central.extended.capabilities.replicas_are_threads
    assert not central.extended.one_replica_per_process


def test_the_data_parallel_extended_is_final():
    with pytest.raises(TypeError, match="DataParallelExtended is final.*ParameterHandling"):
        class SwitchedOff(DataParallelExtended):
            pass


class _OneReplica(ts.Strategy):
    def __init__(self, handling):
        comm = Communicator(None, 0, 1, torch.device("cpu"), ts.NcclAllReduce())
        super().__init__(DataParallelExtended(self, comm, None, handling))


def test_a_handling_serves_one_strategy_and_names_what_it_adds():
    handling = MirroredParameters()
    first = _OneReplica(handling)
    with pytest.raises(RuntimeError, match="already serves _OneReplica"):
        _OneReplica(handling)
    with pytest.raises(AttributeError, match="has no attribute 'mesh'"):
        first.extended.mesh
    with pytest.raises(TypeError, match="needs a ParameterHandling"):
        _OneReplica(object())
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        MirroredParameters(bucket_cap_bytes=0)
