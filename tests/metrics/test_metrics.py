"""ts.metrics.sync: a torchmetrics metric updated inside ``strategy.run`` and computed in
cross-replica context gives the value over every replica's rows, as TensorFlow's
``metric.update_state`` in the step and ``metric.result()`` outside do.

MirroredStrategy runs as 2 real processes (one launch); MultiWorkerMirroredStrategy builds
the same `DataParallelExtended` over the same default process group, so `sync` takes the same path
for it (not launched again). CentralStorageStrategy runs its 2 replicas
as threads of this process. TPUStrategy is documented, not tested here (torchmetrics is not
in the torch_xla environment).
"""
import pickle

import pytest
import torch
import torchmetrics
from torchmetrics.classification import MulticlassAccuracy

import torchstrategy as ts
from tests.helpers.replicas import launch

pytestmark = pytest.mark.timeout(180)

# 7 rows, 3 classes; global batches of 4 (the last one short: 2 rows and 1 row).
TARGET = torch.tensor([0, 1, 2, 1, 0, 2, 2])
PREDS = torch.tensor([0, 1, 1, 1, 2, 2, 0])   # 4 of 7 right


def _logits(preds):
    return torch.nn.functional.one_hot(preds, 3).float()


def _batches():
    return [(PREDS[i:i + 4], TARGET[i:i + 4]) for i in range(0, 7, 4)]


def _expected():
    accuracy = MulticlassAccuracy(num_classes=3, average="micro")
    accuracy.update(PREDS, TARGET)
    return accuracy.compute().item(), PREDS.float().sum().item()


def _metrics(strategy):
    with strategy.scope():   # as TensorFlow code creates its metrics
        accuracy = ts.metrics.sync(MulticlassAccuracy(num_classes=3, average="micro"))
        rows = ts.metrics.sync(torchmetrics.CatMetric())   # a state of uneven lengths
        collection = ts.metrics.sync(torchmetrics.MetricCollection(
            {"acc": MulticlassAccuracy(num_classes=3, average="micro"),
             "sum": torchmetrics.SumMetric()}))
        outside = ts.metrics.sync(MulticlassAccuracy(num_classes=3, average="micro"))
    return accuracy, rows, collection, outside


def _evaluate(strategy):
    accuracy, rows, collection, outside = _metrics(strategy)

    def step(preds, target):
        accuracy.update(_logits(preds), target)     # update_state inside the step
        rows(preds.float())                          # forward: the batch value and update
        collection["acc"].update(preds, target)
        collection["sum"].update(preds.float())
        return _logits(preds)

    for preds, target in strategy.experimental_distribute_dataset(_batches()):
        logits = strategy.run(step, args=(preds, target))
        outside.update(logits, target)   # PerReplica results, in cross-replica context
    result = {name: value.item() for name, value in collection.compute().items()}
    return (accuracy.compute().item(), sorted(rows.compute().tolist()),
            result, outside.compute().item())


def _evaluate_mirrored():
    strategy = ts.MirroredStrategy()
    return strategy.num_replicas_in_sync, _evaluate(strategy)


def _check(result):
    accuracy, rows, collection, outside = result
    expected_accuracy, expected_sum = _expected()
    assert accuracy == pytest.approx(expected_accuracy)
    assert rows == sorted(PREDS.float().tolist())
    assert collection == pytest.approx({"acc": expected_accuracy, "sum": expected_sum})
    assert outside == pytest.approx(expected_accuracy)


def test_mirrored_metrics_compute_the_global_value():
    replicas, result = launch(_evaluate_mirrored, n=2)
    assert replicas == 2
    _check(result)
    # Each replica alone would see other values: replica 0's rows are 0,1 and 4 (2 right).
    assert result[0] != pytest.approx(2 / 3)


def test_central_storage_metrics_from_replica_threads():
    strategy = ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    _check(_evaluate(strategy))


def test_central_storage_forward_from_threads_loses_no_update():
    strategy = ts.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"])
    total = ts.metrics.sync(torchmetrics.SumMetric(), strategy)
    data = [torch.ones(64) for _ in range(8)]
    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(lambda x: [total(x) for _ in range(5)], args=(batch,))
    assert total.compute().item() == 64 * 8 * 5


def test_sync_refuses_what_it_cannot_follow():
    with pytest.raises(TypeError, match="expected a torchmetrics.Metric or MetricCollection"):
        ts.metrics.sync(torch.nn.Linear(2, 2))
    metric = ts.metrics.sync(torchmetrics.SumMetric(), ts.OneDeviceStrategy("cpu"))
    assert not metric.distributed_available_fn()   # one replica: nothing to gather
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(ts.metrics.sync(torchmetrics.SumMetric(),
                                     ts.CentralStorageStrategy(compute_devices=["cpu:0",
                                                                                "cpu:1"])))
