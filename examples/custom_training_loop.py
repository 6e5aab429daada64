"""Custom training with tf.distribute.Strategy, ported to torchstrategy.

A port of TensorFlow's tutorial "Custom training with tf.distribute.Strategy"
(https://www.tensorflow.org/tutorials/distribute/custom_training), section by section and
with the same names, on scikit-learn's digits (8x8 images, bundled, no download) instead
of Fashion-MNIST.

    python examples/custom_training_loop.py                 # every GPU, or 2 CPU replicas
    python examples/custom_training_loop.py --replicas 4
    torchrun --nproc-per-node=2 examples/custom_training_loop.py

What differs from the TensorFlow version:
- Each replica is a process (as with DistributedDataParallel): with several replicas,
  `python examples/custom_training_loop.py` becomes replica 0 and starts the same command
  again for each other replica. All the code below runs in every replica; replica 0
  prints.
- No GradientTape: inside `strategy.run`, ``loss.backward()`` leaves in every ``.grad`` the
  sum of the replicas' gradients (TensorFlow's `apply_gradients` semantics).
- No tf.function: `distributed_train_step` is a plain function.
- Keras metrics become two SyncOnRead variables (a total and a count) each: every replica
  updates its own copy in `strategy.run`; reading the metric outside sums the copies, so
  every replica must read it (then replica 0 prints).
- tf.train.Checkpoint becomes ``ts.checkpoint.save(state_dict, path)`` (replica 0 writes,
  the others wait) and ``ts.checkpoint.load(path)``.
"""
import argparse
import logging
import os
import shutil
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import torchstrategy as ts

# torchstrategy logs through the standard logging module and configures nothing itself.
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

parser = argparse.ArgumentParser(description="Custom training with MirroredStrategy")
parser.add_argument("--replicas", type=int, default=None,
                    help="number of replicas (default: every GPU, or 2 CPU replicas)")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--checkpoint-dir", default=None,
                    help="where to write checkpoints (default: a temporary directory)")


# -- Metrics (tf.keras.metrics, as SyncOnRead variables) ------------------------------------
class Mean:
    """tf.keras.metrics.Mean: a running mean of the values seen on all replicas."""

    def __init__(self, name):
        self.name = name
        # Each replica adds to its own copy; a read outside strategy.run sums the copies.
        self.total = ts.Variable(0., synchronization="ON_READ", aggregation="SUM")
        self.count = ts.Variable(0., synchronization="ON_READ", aggregation="SUM")

    def update_state(self, values):
        self.total.assign_add(values.detach().float().sum())
        self.count.assign_add(values.numel())

    def result(self):
        return (self.total.read_value() / self.count.read_value()).item()

    def reset_state(self):
        self.total.assign(0.)
        self.count.assign(0.)


class SparseCategoricalAccuracy(Mean):
    """tf.keras.metrics.SparseCategoricalAccuracy: the fraction of correct predictions."""

    def update_state(self, labels, predictions):
        super().update_state((predictions.argmax(dim=1) == labels).float())


def replica_devices(n):
    """n GPUs when there are GPUs (default: all of them), else n CPU replicas (default 2)."""
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(n or torch.cuda.device_count())]
    return [f"cpu:{i}" for i in range(n or 2)]


def create_model():
    # The tutorial's convnet; padding keeps 8x8 digits from shrinking to nothing.
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # 32 x 4 x 4
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 64 x 2 x 2
        nn.Flatten(),
        nn.Linear(64 * 2 * 2, 64), nn.ReLU(),
        nn.Linear(64, 10))


def model_losses(model):
    """Keras' model.losses: an L2 kernel regulariser on the first dense layer."""
    return [1e-3 * model[7].weight.square().sum()]


def main():
    args = parser.parse_args()
    torch.manual_seed(0)

    # -- Create a strategy to distribute the variables and the graph ----------------------
    devices = None if "TORCHELASTIC_RUN_ID" in os.environ else replica_devices(args.replicas)
    strategy = ts.MirroredStrategy(devices=devices)
    chief = strategy.extended.is_chief
    if chief:
        print(f"Number of devices: {strategy.num_replicas_in_sync}")

    # -- Setup input pipeline --------------------------------------------------------------
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    train_images, test_images, train_labels, test_labels = train_test_split(
        images, labels, test_size=0.25, random_state=0, stratify=labels)

    BATCH_SIZE_PER_REPLICA = 32
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    EPOCHS = args.epochs

    train_dataset = DataLoader(TensorDataset(train_images, train_labels),
                               batch_size=GLOBAL_BATCH_SIZE, shuffle=True)
    test_dataset = DataLoader(TensorDataset(test_images, test_labels),
                              batch_size=GLOBAL_BATCH_SIZE)
    # Every replica gets its slice of each global batch.
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    # -- Create the model ------------------------------------------------------------------
    # Every replica gets the same directory: replica 0's choice, when it is temporary.
    checkpoint_dir = args.checkpoint_dir or strategy.extended.communicator.broadcast_object(
        tempfile.mkdtemp(prefix="custom_training_loop-") if chief else None)
    checkpoint_path = os.path.join(checkpoint_dir, "ckpt.pt")

    # -- Define the loss function ----------------------------------------------------------
    def compute_loss(labels, predictions, model_losses):
        per_example_loss = F.cross_entropy(predictions, labels, reduction="none")
        # Summed over replicas (by backward), this is the mean loss of the global batch.
        loss = ts.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
        if model_losses:
            # Added once per replica, so divided by the number of replicas.
            loss = loss + ts.scale_regularization_loss(sum(model_losses))
        return loss

    # -- Define the metrics to track loss and accuracy -------------------------------------
    with strategy.scope():
        test_loss = Mean("test_loss")
        train_accuracy = SparseCategoricalAccuracy("train_accuracy")
        test_accuracy = SparseCategoricalAccuracy("test_accuracy")

    # -- Training loop ---------------------------------------------------------------------
    # A model, an optimizer and a checkpoint must be created under `strategy.scope`.
    with strategy.scope():
        model = create_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def train_step(inputs):
        images, labels = inputs
        predictions = model(images)
        loss = compute_loss(labels, predictions, model_losses(model))
        optimizer.zero_grad()
        loss.backward()          # each .grad is now the sum over replicas
        optimizer.step()
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        with torch.no_grad():
            predictions = model(images)
            t_loss = F.cross_entropy(predictions, labels, reduction="none")
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(ts.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    for epoch in range(EPOCHS):
        # TRAIN LOOP
        model.train()
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        train_loss = total_loss / num_batches

        # TEST LOOP
        model.eval()
        for x in test_dist_dataset:
            distributed_test_step(x)

        if epoch % 2 == 0 or epoch == EPOCHS - 1:
            # Every replica calls save; replica 0 writes, the others wait for it.
            ts.checkpoint.save({"model": model.state_dict(),
                                "optimizer": optimizer.state_dict()}, checkpoint_path)

        # Reading a metric is a collective: every replica reads, replica 0 prints.
        results = (epoch + 1, train_loss.item(), train_accuracy.result() * 100,
                   test_loss.result(), test_accuracy.result() * 100)
        if chief:
            print("Epoch {}, Loss: {:.4f}, Accuracy: {:.2f}, Test Loss: {:.4f}, "
                  "Test Accuracy: {:.2f}".format(*results))

        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()

    # -- Restore the latest checkpoint and test --------------------------------------------
    # The checkpoint holds a plain state_dict: it loads into a model made without any
    # strategy. Replica 0 evaluates it on the whole test set, as the tutorial does.
    if chief:
        new_model = create_model()
        new_optimizer = torch.optim.Adam(new_model.parameters())
        checkpoint = ts.checkpoint.load(checkpoint_path)
        new_model.load_state_dict(checkpoint["model"])
        new_optimizer.load_state_dict(checkpoint["optimizer"])
        new_model.eval()
        correct = 0
        with torch.no_grad():
            for images, labels in test_dataset:
                correct += (new_model(images).argmax(dim=1) == labels).sum().item()
        eval_accuracy = correct / len(test_labels)
        print("Accuracy after restoring the saved model without strategy: {:.2f}".format(
            eval_accuracy * 100))
        print(f"test accuracy: {eval_accuracy:.4f}")
        if args.checkpoint_dir is None:
            shutil.rmtree(checkpoint_dir)


if __name__ == "__main__":
    main()
