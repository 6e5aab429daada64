"""`BackupAndRestore`: resume a custom training loop where it stopped (TensorFlow's name).

A job restarted after a failure (``torchrun --max-restarts``, a rescheduled machine) runs
the same program again from the top. With a backup it picks up at the step it had reached,
with the same parameters, optimizer state, data position and random numbers, so its final
parameters are those of a run that never stopped::

    backup = ts.BackupAndRestore("/shared/backup", save_freq=100)
    backup.track(model=model, optimizer=optimizer)       # restores, if there is a backup
    for epoch in backup.epochs(EPOCHS):                  # from the epoch it stopped in
        for step, batch in backup.steps(dist_data):      # from the step it stopped at
            strategy.run(train_step, args=(batch,))
    # finished: the backup is deleted (delete_checkpoint=True)

What a backup holds: the `state_dict()` of every tracked object; the position (epoch, step
within it, steps done); the state of every dataset iterated with `steps` (its epoch and its
shuffling seed); and the random number generators of every replica (torch's CPU and CUDA
generators, Python's `random`, NumPy's global generator).

A backup restores onto a different number of replicas (written by N, resumed on M): the
position is kept in global batches, the same samples whatever the number of replicas, so
keep the loader's global batch size; each replica's batch changes from G/N to G/M. A
changed global batch, or one that M does not divide, is refused with a ValueError when the
dataset is first iterated. Random states are restored only when M == N.

Every replica calls the same methods at the same points (they are collectives). The chief
(replica 0) writes the backup atomically (a temporary file, flushed, renamed), so a crash
while writing leaves the previous backup intact; at start the chief reads it and sends it to
the others, so only the chief's machine needs to see `backup_dir`.
"""
from __future__ import annotations

import itertools
import os
import pickle
from typing import Any, Iterable, Iterator, Mapping

import torch

from torchstrategy.checkpoint import (owning_extended, peers_of, remove_stale_temporaries,
                                      write_atomically)
from torchstrategy.collectives.peers import Peers
from torchstrategy.input.distributed_dataset import DistributedDataset
from torchstrategy.resumption import (check_resize, global_batch_size, rng_state,
                                      set_rng_state)

_FILE = "backup.pt"


def check_private(directory: str | os.PathLike[str]) -> None:
    """Refuses a backup directory that someone else could have planted a backup in."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return
    others_write = info.st_mode & 0o022
    if others_write or info.st_uid != os.geteuid():
        who = "writable by other users" if others_write else f"owned by uid {info.st_uid}"
        raise PermissionError(
            f"BackupAndRestore refuses the backup directory {directory}: it is {who} "
            f"(mode {info.st_mode & 0o777:o}), so someone else could plant a backup in it. "
            f"Use a directory of this job only, or run `chmod go-w {directory}` (and make it "
            "yours) if you trust it.")


class BackupAndRestore:
    """Backs a custom training loop up as it runs and restores it after a restart.

    Args:
      backup_dir: where the chief keeps the backup (``backup_dir/backup.pt``). Use a
        directory of this job only; on a cluster, one on the chief's machine (or shared).
      save_freq: ``"epoch"``: back up at the end of every epoch; an int N: back up every N
        steps (counted over the whole run, across epochs).
      delete_checkpoint: delete the backup when `epochs` finishes the last epoch, so that
        the next run of the program starts afresh (TensorFlow's default).

    Use `track` for what to save, `epochs` and `steps` for the loops, `save` to back up at
    another moment. `epoch`, `step` and `global_step` give the position at any time, and
    `restored` tells whether this run resumed from a backup.

    Raises:
      ValueError: a `save_freq` that is neither "epoch" nor a positive int.
    """

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True) -> None:
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(
                save_freq, int) or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or a positive number of steps, got "
                             f"{save_freq!r}.")
        self.backup_dir = os.path.abspath(os.fspath(backup_dir))
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.epoch = 0          # the epoch running (or next to run)
        self.step = 0           # the step of `epoch` running (or next to run)
        self.global_step = 0    # steps finished since training began
        self.restored = False
        self._objects: dict[str, Any] = {}
        self._datasets: list[Any] = []     # iterated with steps(), in order of first use
        self._pending_datasets: list[Any] = []
        self._pending_rng: dict[str, Any] | None = None
        self._pending_batches: list[int | None] = []
        self._written_replicas: int | None = None
        # the random state when the current epoch's steps began
        self._epoch_rng: dict[str, Any] | None = None
        if self._peers().is_chief:
            self._open_directory()

    def _extended(self) -> Any:
        """The extended of the strategy the tracked objects belong to (`owning_extended`)."""
        return owning_extended(*self._objects.values())

    def _peers(self) -> Peers:
        """The replicas that back up together (`peers_of` the owning strategy)."""
        return peers_of(self._extended())

    def _open_directory(self) -> None:
        """Checks that only this user can write the directory, and removes temporaries
        that a backup write killed midway left behind (only the chief writes here)."""
        check_private(self.backup_dir)
        remove_stale_temporaries(self.backup_dir)

    @property
    def path(self) -> str:
        """The backup file."""
        return os.path.join(self.backup_dir, _FILE)

    # -- what to back up -----------------------------------------------------------------
    def track(self, **objects: Any) -> BackupAndRestore:
        """Backs up these objects from now on and, if a backup exists, restores them now.

        Args:
          **objects: name -> anything with ``state_dict()`` and ``load_state_dict()``: the
            model, the optimizer, a learning-rate scheduler, a GradScaler... Names must stay
            the same between runs.

        Returns:
          self.

        Raises:
          TypeError: an object without state_dict/load_state_dict.
          KeyError: a backup that lacks one of the names (it was written by other code).
        """
        for name, obj in objects.items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"BackupAndRestore.track: {name}={obj!r} has no "
                                "state_dict()/load_state_dict(); track models, optimizers, "
                                "schedulers and other objects that have them.")
        self._objects.update(objects)
        payload = self._read()
        if payload is not None:
            self._restore(payload, objects)
        return self

    def _read(self) -> Any:
        """The backup's contents (None: there is none), read by the chief and sent to every
        replica; every replica raises the chief's error if it could not read it."""
        def read() -> Any:
            if not os.path.exists(self.path):
                return None
            try:
                check_private(self.backup_dir)
                # weights_only: tensors and plain values only; a planted pickle runs nothing.
                return torch.load(self.path, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as caught:
                raise pickle.UnpicklingError(
                    f"The backup {self.path} holds objects other than tensors and plain "
                    f"values and was not loaded ({str(caught).splitlines()[0]}). It was not "
                    "written by this version of BackupAndRestore, or someone else wrote it; "
                    "delete it to start afresh.") from None
        peers = self._peers()
        with peers.explained("BackupAndRestore's read of the backup"):
            return peers.run_on_chief(read)

    def _restore(self, payload: dict[str, Any], objects: Mapping[str, Any]) -> None:
        missing = [name for name in objects if name not in payload["objects"]]
        if missing:
            raise KeyError(f"The backup at {self.path} has no state for {missing} (it holds "
                           f"{sorted(payload['objects'])}). Track the same names as the run "
                           "that wrote it, or remove the backup to start afresh.")
        extended = self._extended()
        for name, obj in objects.items():
            extended.load_state_dict_from_checkpoint(obj, payload["objects"][name])
        if self.restored:
            return  # the position and RNG were restored by an earlier track()
        self.restored = True
        self.epoch, self.step = payload["epoch"], payload["step"]
        self.global_step = payload["global_step"]
        self._pending_datasets = list(payload["datasets"])
        self._pending_batches = list(payload.get("global_batch_sizes", ()))
        self._written_replicas = payload.get("num_replicas", len(payload["rng"]))
        peers = self._peers()
        # The random states are per replica: restored only onto as many replicas as wrote
        # them (after a resize, each replica keeps the state its program gave it).
        if len(payload["rng"]) == peers.world_size:
            rng = payload["rng"][peers.rank]
            if self.step == 0:
                set_rng_state(rng["now"])
            else:
                # Mid-epoch: the interrupted run had set up this epoch's iterator (which
                # draws random numbers: shuffling, the loader's base seed) and fetched the
                # batches already done before the backup. `steps` redoes that from the
                # state the epoch began with, then sets the state of the backup.
                self._pending_rng = rng

    # -- the loops -----------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Yields the epochs still to run, from the one the backup stopped in (0 on a fresh
        start) to ``num_epochs - 1``. With ``save_freq="epoch"`` a backup is written after
        each epoch's body; after the last epoch the backup is deleted (`delete_checkpoint`).
        """
        for epoch in range(self.epoch, num_epochs):
            self.epoch = epoch
            yield epoch
            self.epoch, self.step = epoch + 1, 0
            if self.save_freq == "epoch":
                self.save()
        if self.delete_checkpoint:
            self.delete()

    def steps(self, data: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        """Yields ``(step, batch)`` for the rest of the current epoch of `data`.

        `data` is a distributed dataset (``strategy.experimental_distribute_dataset``), a
        DataLoader or any iterable; its epoch is set (``set_epoch``) and, when resuming, the
        steps already done are skipped (a distributed DataLoader skips their indices without
        loading them). With an int `save_freq` a backup is written every `save_freq` steps,
        after the step's body. Datasets are backed up in the order `steps` first sees them.

        Use it for the training data, once per epoch; iterate evaluation data directly (its
        batches are not training steps).
        """
        index = next((i for i, d in enumerate(self._datasets) if d is data), None)
        if index is None:
            index = len(self._datasets)
            self._datasets.append(data)
            if index < len(self._pending_datasets):
                written = self._pending_batches[index] if index < len(
                    self._pending_batches) else None
                check_resize(self._written_replicas, self._peers().world_size,
                             {f"dataset {index}": (written, global_batch_size(data))},
                             f"The backup {self.path}")
                if self._pending_datasets[index] is not None \
                        and hasattr(data, "load_state_dict"):
                    data.load_state_dict(self._pending_datasets[index])
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng["epoch_start"])
        self._epoch_rng = rng_state()
        iterator = self._positioned_iterator(data, self.epoch, self.step)
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng["now"])
            self._pending_rng = None
        for step, batch in enumerate(iterator, self.step):
            self.step = step
            yield step, batch
            self.step = step + 1
            self.global_step += 1
            if isinstance(self.save_freq, int) and self.global_step % self.save_freq == 0:
                self.save()

    @staticmethod
    def _positioned_iterator(data: Any, epoch: int, start_step: int) -> Iterator[Any]:
        if isinstance(data, DistributedDataset):
            data.set_epoch(epoch, start_step)
            return iter(data)  # skips the first start_step steps now
        if callable(getattr(data, "set_epoch", None)):
            data.set_epoch(epoch)
        elif callable(getattr(getattr(data, "sampler", None), "set_epoch", None)):
            data.sampler.set_epoch(epoch)  # a DataLoader with a DistributedSampler
        iterator = iter(data)
        for _ in itertools.islice(iterator, start_step):
            pass  # the steps done before the backup, skipped now (not at the first batch)
        return iterator

    # -- writing -------------------------------------------------------------------------
    def save(self) -> None:
        """Backs up the tracked objects and the position now (every replica calls it; the
        chief writes, and every replica raises the chief's error if it could not).
        `epochs` and `steps` call it per `save_freq`."""
        peers = self._peers()
        with peers.explained("BackupAndRestore's save"):
            rng = peers.gather_to_chief({"now": rng_state(), "epoch_start": self._epoch_rng})
        # Every replica takes part: a strategy that shards parameters gathers them here.
        extended = self._extended()
        states = {name: extended.state_dict_for_checkpoint(obj)
                  for name, obj in self._objects.items()}
        with peers.explained("BackupAndRestore's save"):
            peers.run_on_chief(lambda: self._write(rng, states, peers.world_size))

    def _write(self, rng: list[Any] | None, states: dict[str, Any], replicas: int) -> None:
        datasets = [d.state_dict() if callable(getattr(d, "state_dict", None)) else None
                    for d in self._datasets]
        payload = {"epoch": self.epoch, "step": self.step,
                   "global_step": self.global_step,
                   "objects": states,
                   "datasets": datasets, "rng": rng, "num_replicas": replicas,
                   "global_batch_sizes": [global_batch_size(d) for d in self._datasets]}
        # Datasets are saved at the start of the epoch in progress (a mid-epoch backup
        # resumes that epoch, whose iteration already advanced their counter).
        for state in datasets:
            if isinstance(state, dict) and "epoch" in state:
                state["epoch"] = self.epoch
        write_atomically(payload, self.path, directory_mode=0o700)

    def delete(self) -> None:
        """Removes the backup (the chief does; every replica calls it)."""
        def remove() -> None:
            if os.path.exists(self.path):
                os.unlink(self.path)
            try:
                os.rmdir(self.backup_dir)
            except OSError:
                pass  # not empty (the user's files) or already gone
        peers = self._peers()
        with peers.explained("BackupAndRestore's deletion of the backup"):
            peers.run_on_chief(remove)

    def __repr__(self) -> str:
        return (f"BackupAndRestore({self.backup_dir!r}, save_freq={self.save_freq!r}, "
                f"epoch={self.epoch}, step={self.step})")
