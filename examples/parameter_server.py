"""Parameter server training with ParameterServerStrategy, ported to torchstrategy.

A port of TensorFlow's tutorial "Parameter server training with ParameterServerStrategy"
(https://www.tensorflow.org/tutorials/distribute/parameter_server_training), custom
training loop part, with the same names, on scikit-learn's digits (bundled, no download).

    python examples/parameter_server.py                     # an in-process local cluster
    python examples/parameter_server.py --workers 3 --ps 2

What differs from the TensorFlow version:
- The in-process cluster is `ts.parameter_server.local_cluster`: the workers and parameter
  servers are `python -m torchstrategy.server` subprocesses on 127.0.0.1. On real machines
  start one server per task with TF_CONFIG set and create the strategy with
  `ts.TFConfigClusterResolver()` on the chief.
- No GradientTape or tf.function: the step is a plain function run on a worker. The model
  and optimizer are passed to it; there the model holds the parameters pulled from the
  parameter servers, and `optimizer.step()` pushes the gradients, which the servers apply.
- Keras metrics become counters held by the parameter servers (`assign_add` is atomic).
"""
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import torchstrategy as ts

parser = argparse.ArgumentParser(description="Parameter server training on digits")
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--ps", type=int, default=2)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--steps-per-epoch", type=int, default=60)


def load_data():
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    return train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)


class ShuffledBatches:
    """An endless, shuffled, batched pass over the training set (a `tf.data` pipeline
    with shuffle().repeat().batch())."""

    def __init__(self, seed, batch_size=64):
        self.seed, self.batch_size = seed, batch_size

    def __iter__(self):
        x_train, _, y_train, _ = load_data()
        g = torch.Generator().manual_seed(self.seed)
        while True:
            order = torch.randperm(len(x_train), generator=g)
            for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
                idx = order[start:start + self.batch_size]
                yield x_train[idx], y_train[idx]


def dataset_fn(input_context):
    # Each worker shuffles with its own seed, as each tf.data pipeline does.
    return ShuffledBatches(seed=input_context.input_pipeline_id)


def step_fn(model, optimizer, iterator, correct, seen):
    """One training step, run on a worker."""
    features, labels = next(iterator)
    logits = model(features)
    loss = F.cross_entropy(logits, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()          # the parameter servers apply the update
    correct.assign_add(float((logits.argmax(1) == labels).sum()))
    seen.assign_add(float(len(labels)))
    return loss.detach()


def main():
    args = parser.parse_args()
    torch.manual_seed(0)

    # -- Cluster setup ---------------------------------------------------------------------
    with ts.parameter_server.local_cluster(num_workers=args.workers,
                                           num_ps=args.ps) as cluster_resolver:

        # -- Instantiate a ParameterServerStrategy --------------------------------------
        variable_partitioner = ts.parameter_server.MinSizePartitioner(
            min_shard_bytes=(256 << 10), max_shards=args.ps)
        strategy = ts.ParameterServerStrategy(cluster_resolver,
                                              variable_partitioner=variable_partitioner)

        # -- Build the model (its parameters live on the parameter servers) -------------
        with strategy.scope():
            model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
            accuracy_correct = ts.Variable(0.0, trainable=False)
            accuracy_seen = ts.Variable(0.0, trainable=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        # -- Dispatch training steps to remote workers ----------------------------------
        coordinator = ts.ClusterCoordinator(strategy)
        per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)
        per_worker_iterator = iter(per_worker_dataset)

        for epoch in range(args.epochs):
            accuracy_correct.assign(0.0)
            accuracy_seen.assign(0.0)
            for _ in range(args.steps_per_epoch):
                loss = coordinator.schedule(step_fn, args=(
                    model, optimizer, per_worker_iterator, accuracy_correct, accuracy_seen))
            # Wait at epoch boundaries.
            coordinator.join()
            accuracy = float(accuracy_correct.read_value() / accuracy_seen.read_value())
            print(f"Finished epoch {epoch}, loss is {float(loss.fetch()):.4f}, "
                  f"accuracy is {accuracy:.4f}.")

        # -- Inline evaluation on the coordinator ---------------------------------------
        _, x_test, _, y_test = load_data()
        with torch.no_grad():   # the chief's model reads the parameter servers' values
            test_accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        print(f"test accuracy: {test_accuracy:.4f}")


if __name__ == "__main__":
    main()
