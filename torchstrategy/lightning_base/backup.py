"""`BackupAndRestoreCallback`: TensorFlow's BackupAndRestore (``Model.fit``) for Lightning.

    trainer = pl.Trainer(strategy="mirrored", devices=2, max_epochs=10,
                         callbacks=[BackupAndRestoreCallback("backup/", save_freq=50)])
    trainer.fit(model, data)      # run the same command again after a crash: it resumes

The callback only decides *when* to back up and *what to restore from*; the backup itself
is a Lightning checkpoint (``trainer.save_checkpoint``), and restoring it is Lightning's own
resume (``fit(ckpt_path=...)``'s code path): model, optimizers, LR schedulers, precision
state, the fit loop's position (epoch, global step, batch within the epoch) and the state
of resumable dataloaders. The callback adds what a Lightning checkpoint lacks: every
replica's random number generators, so the run continues with the numbers it would have
drawn.

`BackupAndRestoreCallback` holds the behaviour; `callback_class` combines it with each
Lightning package's ``Callback`` (published in `torchstrategy.lightning.lightning_pytorch`
and `.pytorch_lightning`). This module imports no Lightning until a callback is made.
"""
from __future__ import annotations

import importlib
import os
from typing import Any

from torchstrategy import _compat
from torchstrategy import backup_and_restore as _backup
from torchstrategy import checkpoint, resumption
from torchstrategy.lightning_base import adapter

_FILE = "backup.ckpt"


def callback_class(package: str | None = None) -> type[BackupAndRestoreCallback]:
    """The callback class of `package` ("lightning.pytorch" or "pytorch_lightning"; None:
    the one in use), a subclass of that package's ``Callback`` and of
    `BackupAndRestoreCallback`, defined once per process (with the package's adapter
    class, which registers our strategy names)."""
    package = package or adapter.packages_in_use()[0]
    adapter.strategy_class(package)

    def define() -> type[BackupAndRestoreCallback]:
        # Lightning is an optional dependency, imported only here, on use.
        callback = importlib.import_module(f"{package}.callbacks").Callback
        return adapter.new_package_class("BackupAndRestoreCallback",
                                         (BackupAndRestoreCallback, callback), package,
                                         {"__doc__": CLASS_DOC, "package": package})
    return adapter.defined_once(BackupAndRestoreCallback, package, define)


class BackupAndRestoreCallback:
    # The docstring is CLASS_DOC, at the end of this module.
    # This class holds the callback's behaviour and is what isinstance checks against;
    # `callback_class` combines it with each Lightning package's ``Callback`` and sets
    # `package`.

    package: str | None = None   # "lightning.pytorch" or "pytorch_lightning", set by the subclass

    def __new__(cls, *args: Any, package: str | None = None, **kwargs: Any) -> Any:
        # BackupAndRestoreCallback(...) makes an instance of the callback class of the
        # Lightning package in use (or of `package`).
        adapter.check_package(package)
        if cls.package is not None and package in (None, cls.package):
            return super().__new__(cls)
        target = callback_class(package)
        if issubclass(target, cls):
            return super().__new__(target)   # type() then calls target's __init__
        # The other package's class was called with package=: build it whole.
        return target(*args, package=package, **kwargs)

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True, *, package: str | None = None) -> None:
        adapter.check_package(package)
        _backup.BackupAndRestore(backup_dir, save_freq)  # the same argument checks
        self.backup_dir = os.path.abspath(os.fspath(backup_dir))
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.restored = False
        self._trainer: Any = None   # Lightning's Trainer, once set up
        self._restored_global_step: int | None = None
        self._rng_to_apply: dict[str, Any] | None = None
        self._at_epoch_end = False

    @property
    def path(self) -> str:
        """The backup file: ``backup_dir/backup.ckpt`` (a Lightning checkpoint)."""
        return os.path.join(self.backup_dir, _FILE)

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a Lightning checkpoint (one per backup
        directory)."""
        return f"BackupAndRestoreCallback[{self.backup_dir}]"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Lightning's hook: when fitting and a backup exists, starts Lightning's resume
        from it."""
        self._trainer = trainer
        if stage != "fit":
            return
        exists = os.path.exists(self.path) if trainer.is_global_zero else None
        if not trainer.strategy.broadcast(exists, src=0):
            return
        # Lightning's resume, started here because the path is only known now: it
        # loads the checkpoint and restores model and callbacks; the Trainer then
        # restores loops, optimizers and schedulers from the loaded checkpoint.
        _compat.lightning_restore_from_checkpoint(trainer, self.path)
        self.restored = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Lightning's hook: refuses a run whose step is not the restored backup's."""
        if self.restored and trainer.global_step != self._restored_global_step:
            raise RuntimeError(
                f"BackupAndRestoreCallback restored {self.path} at global step "
                f"{self._restored_global_step}, but the Trainer is at step "
                f"{trainer.global_step}: another checkpoint replaced it (was fit() given "
                f"ckpt_path=?). Remove the backup or the ckpt_path argument.")

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        """Lightning's hook: applies a mid-epoch backup's random state before its step."""
        # A backup from the middle of an epoch: applied just before the next step, so
        # the step draws the numbers the interrupted run would have drawn.
        if self._rng_to_apply is not None:
            resumption.set_rng_state(self._rng_to_apply)
            self._rng_to_apply = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Lightning's hook: backs up every `save_freq` steps (an int `save_freq`)."""
        if isinstance(self.save_freq, int) and trainer.global_step % self.save_freq == 0:
            self._save(trainer, trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """Lightning's hook: backs up at the end of each epoch (``save_freq="epoch"``)."""
        if self.save_freq == "epoch":
            self._save(trainer, at_epoch_end=True)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Lightning's hook: removes the backup (`delete_checkpoint`) once fit returns."""
        # Reached only when fit returns normally (an exception skips it).
        if self.delete_checkpoint and trainer.is_global_zero:
            if os.path.exists(self.path):
                os.unlink(self.path)
            if os.path.isdir(self.backup_dir) and not os.listdir(self.backup_dir):
                os.rmdir(self.backup_dir)
        trainer.strategy.barrier("BackupAndRestoreCallback.on_fit_end")

    def _save(self, trainer: Any, at_epoch_end: bool) -> None:
        # Every replica takes part (the checkpoint collects every replica's state);
        # the chief writes a temporary file, flushes it and renames it over the
        # backup, so a crash while writing leaves the previous backup whole.
        self._at_epoch_end = at_epoch_end
        temporary = os.path.join(self.backup_dir, f".{_FILE}.tmp")
        trainer.save_checkpoint(temporary)
        if trainer.is_global_zero:
            with open(temporary, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(temporary, self.path)
        trainer.strategy.barrier("BackupAndRestoreCallback._save")

    def state_dict(self) -> dict[str, Any]:
        """This callback's part of a Lightning checkpoint: every replica's random state
        (gathered on the chief), whether it was taken at an epoch's end, the step."""
        # Called on every replica while a checkpoint is made; gathers every
        # replica's generators (the chief writes them all).
        trainer = self._trainer
        module = trainer.lightning_module if trainer is not None else None
        peers = checkpoint.peers_of(checkpoint.owning_extended(module))
        with peers.explained("BackupAndRestoreCallback's gathering of random states"):
            rng = peers.gather_to_chief(resumption.rng_state())
        return {"rng": rng,
                "at_epoch_end": self._at_epoch_end,
                "global_step": trainer.global_step if trainer is not None else 0}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what `state_dict` returned: the random state (now at an epoch's end,
        else before the next step) and the step to resume at.

        Raises:
          ValueError: a backup written by another number of replicas.
        """
        rng = state_dict["rng"]
        rank = self._trainer.global_rank if self._trainer is not None else 0
        replicas = self._trainer.world_size if self._trainer is not None else 1
        if len(rng) != replicas:
            raise ValueError(
                f"The backup in {self.backup_dir} was written by {len(rng)} replicas but "
                f"this run has {replicas}: resume with the same number "
                f"of replicas, or remove the backup to start afresh.")
        if state_dict["at_epoch_end"]:
            # Applied now, before the Trainer makes the next epoch's data iterator
            # (which draws a seed), as the uninterrupted run did after the backup.
            resumption.set_rng_state(rng[rank])
        else:
            self._rng_to_apply = rng[rank]
        self._restored_global_step = state_dict["global_step"]


BackupAndRestoreCallback.__doc__ = CLASS_DOC = """Backs a Lightning ``fit`` up as it runs and resumes it when run again.

    Keras's ``tf.keras.callbacks.BackupAndRestore`` for ``Trainer.fit``: when ``fit``
    starts and ``backup_dir`` holds a backup, training continues from it (model,
    optimizers, LR schedulers, epoch, global step, batch within the epoch, every
    replica's random generators), so a job re-run after a failure ends with the
    parameters of a run that never stopped. While training, the chief backs up at the
    end of every epoch (``save_freq="epoch"``) or every N optimizer steps
    (``save_freq=N``), atomically. When ``fit`` finishes normally the backup (and
    ``backup_dir`` if then empty) is deleted (``delete_checkpoint=True``).

    Every replica reads the backup when ``fit`` starts (Lightning's checkpoint loading),
    so ``backup_dir`` must be visible to all of them (shared storage across machines).
    A backup taken in the middle of an epoch resumes at the next batch only when the
    training dataloader is resumable (Lightning's ``state_dict``/``load_state_dict``
    protocol, e.g. torchdata's ``StatefulDataLoader``); with a plain ``DataLoader``,
    Lightning restarts that epoch's data from its beginning and warns.

    ``BackupAndRestoreCallback(...)`` returns an instance of the callback class of the
    Lightning package in use (pass ``package=`` to choose), a subclass of that package's
    ``Callback`` and of this class, for ``Trainer(callbacks=[...])``.

    Args:
      backup_dir: directory of this job's backup (``backup_dir/backup.ckpt``).
      save_freq: ``"epoch"``, or a positive int N: every N optimizer steps.
      delete_checkpoint: delete the backup when ``fit`` completes.
      package: "lightning.pytorch" or "pytorch_lightning" (default: the one in use).

    Raises:
      ValueError: a ``save_freq`` that is neither "epoch" nor a positive int, or an
        unknown `package`.
    """
