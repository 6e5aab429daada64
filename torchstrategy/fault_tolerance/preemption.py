"""`PreemptionCheckpointHandler`: save once when the cluster takes a machine away, resume.

TensorFlow's ``tf.distribute.experimental.PreemptionCheckpointHandler`` for torchstrategy::

    handler = ts.PreemptionCheckpointHandler(
        strategy.cluster_resolver, {"model": model, "optimizer": optimizer, "data": dist_data},
        "/shared/preemption")                    # restores, if a checkpoint is there
    STEPS = len(dist_data)
    for epoch in range(handler.total_run_calls // STEPS, EPOCHS):
        dist_data.set_epoch(epoch, handler.total_run_calls % STEPS)
        for batch in dist_data:
            handler.run(distributed_train_step, batch)   # one step per call

What happens on a termination notice (a signal, SIGTERM by default, to any one replica):

1. at its next `run`, that replica claims the preemption in the rendezvous store and
   publishes "save after c + 1 steps" (c: the steps it has finished); every replica checks
   that key before each step (one store request), so all of them stop after the same step
   (see `agreement` for why this holds without a collective);
2. before the first step past it, every replica hands its random state to the chief
   through the store, and the chief writes one checkpoint atomically (temporary file,
   fsync, rename); the other replicas wait (bounded) until the chief says it is written;
3. every replica calls `exit_fn`: by default ``sys.exit(42)``, which torchrun's
   ``--max-restarts`` restarts and a SLURM job can be requeued on.

On restart the handler (made at the same point of the program) restores the objects, the
random states and `total_run_calls`, so the loop continues with the next step. The objects
are those of `checkpoint`: a dict of name -> anything with ``state_dict()`` /
``load_state_dict()`` (model, optimizer, scheduler, and the distributed dataset, whose
state holds the position of its loader's random generators).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import secrets
import stat
import tempfile
import time
from typing import Any, Callable, Iterator, Mapping

import torch

from torchstrategy import _compat
from torchstrategy.checkpoint import (owning_extended, peers_of, remove_stale_temporaries,
                                      write_atomically)
from torchstrategy.cluster_resolver import ClusterResolver
from torchstrategy.fault_tolerance.agreement import (LocalAgreement, SaveFailedError,
                                                     StoreAgreement)
from torchstrategy.fault_tolerance.termination import (RESTART_EXIT_CODE, TerminationConfig,
                                                       Watcher, exit_for_restart,
                                                       install_default_log_handler)
from torchstrategy.launch import restart_marker
from torchstrategy.launch import world as world_lib
from torchstrategy.resumption import check_resize, global_batch_size, rng_state, set_rng_state

logger = logging.getLogger("torchstrategy")

CHECKPOINT_FILE = "preemption.pt"
_FORMAT = 1
# Margin left of a grace period, in units of (two steps + one save), as TensorFlow does.
_GRACE_MARGIN = 3


def _check_objects(checkpoint: Any) -> None:
    if not isinstance(checkpoint, dict):
        raise TypeError(f"PreemptionCheckpointHandler: checkpoint must be a dict of name -> "
                        f"object with state_dict()/load_state_dict() (e.g. {{'model': model, "
                        f"'optimizer': optimizer}}), got {checkpoint!r}.")
    for name, obj in checkpoint.items():
        if not isinstance(name, str):
            raise TypeError(f"PreemptionCheckpointHandler: checkpoint names must be strings, "
                            f"got {name!r}.")
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"PreemptionCheckpointHandler: checkpoint[{name!r}]={obj!r} has no "
                            "state_dict()/load_state_dict(); checkpoint models, optimizers, "
                            "schedulers, distributed datasets and other objects that have "
                            "them.")


def _check_resolver(cluster_resolver: ClusterResolver | None) -> None:
    if cluster_resolver is None:
        return
    if not isinstance(cluster_resolver, ClusterResolver):
        raise TypeError(f"PreemptionCheckpointHandler: cluster_resolver must be a "
                        f"ts.cluster_resolver.ClusterResolver (strategy.cluster_resolver) or "
                        f"None, got {cluster_resolver!r}.")
    spec = cluster_resolver.cluster_spec()
    if "ps" in spec.jobs:
        raise NotImplementedError(
            "PreemptionCheckpointHandler does not support ParameterServerStrategy (as in "
            "TensorFlow): its workers do not step together. Use BackupAndRestore on the "
            "coordinator.")
    if cluster_resolver.task_type is not None and spec.jobs:
        cluster_resolver.worker_index  # raises, naming the task, for a non-training task


def _check_directory(directory: str) -> None:
    """Refuses, on the chief at construction, a checkpoint directory the save would fail in
    or that someone else could plant a checkpoint in; creates it (mode 700) when missing.

    Raises:
      NotADirectoryError: `directory` (or a parent) is a file.
      PermissionError: it cannot be made, is not writable by this process, is writable by
        other users, or belongs to another user.
    """
    what = f"PreemptionCheckpointHandler: checkpoint_dir {directory}"
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"{what} is a file, not a directory. Give the path of a "
                                 "directory (it is created if missing) for this job's "
                                 "checkpoint, e.g. one next to that file.")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as error:
        kind = NotADirectoryError if error.errno == errno.ENOTDIR else PermissionError
        raise kind(f"{what} does not exist and cannot be created ({error.strerror}: "
                   f"{error.filename}). Give a directory this job can create and write, or "
                   "create it first.") from None
    info = os.stat(directory)
    if info.st_mode & 0o022 or info.st_uid != os.geteuid():
        who = ("writable by every user" if info.st_mode & 0o002 else
               "writable by its group" if info.st_mode & 0o020 else
               f"owned by another user (uid {info.st_uid})")
        raise PermissionError(
            f"{what} is {who} (mode {stat.S_IMODE(info.st_mode):o}): someone else could "
            "replace the checkpoint this job restores from. Give a directory of this job "
            f"only (the handler creates a missing one with mode 700), or, if you trust it, "
            f"run `chmod go-w {directory}` (and own it).")
    # Try the write itself: permissions, a read-only mount, a full disk or a quota all
    # show now rather than when the preemption comes and the checkpoint would be lost.
    try:
        handle, probe = tempfile.mkstemp(prefix=".probe-", dir=directory)
    except OSError as error:
        raise PermissionError(f"{what} is not writable by this process ({error.strerror}); "
                              "the checkpoint could not be saved when a preemption comes. "
                              f"Make it writable (`chmod u+w {directory}`, a read-write "
                              "mount) or give another directory.") from None
    try:
        os.write(handle, b"0")
    finally:
        os.close(handle)
        os.unlink(probe)


class PreemptionSaveError(RuntimeError):
    """A preemption save failed on some replica: raised on every replica with the first
    failure's reason (so it is not wrapped again as another replica's failure)."""


def _mismatch(error: BaseException) -> str:
    """The first specific line of a load_state_dict error (torch puts it second)."""
    lines = [line.strip() for line in str(error).strip().splitlines()[1:] if line.strip()]
    return lines[0].rstrip(".") if lines else "see the cause below"


def _first_line(error: BaseException) -> str:
    """``Type: first sentence`` of an error (torch's zip errors run on for a paragraph)."""
    lines = str(error).strip().splitlines()
    first = lines[0].split(". ")[0].rstrip(".") if lines else ""
    return f"{type(error).__name__}: {first}".rstrip(": ")


class PreemptionCheckpointHandler:
    """Saves a checkpoint at a step every replica agrees on when any one of them is told
    it will be terminated, exits for a restart, and restores that checkpoint on restart.

    Args:
      cluster_resolver: the strategy's `ClusterResolver` (``strategy.cluster_resolver``), or
        None. The replicas are those of the default process group (one per process; the
        chief, rank 0, writes). A resolver of a cluster with parameter servers is refused.
      checkpoint: dict of name -> object with ``state_dict()`` / ``load_state_dict()``.
        Names must stay the same between runs.
      checkpoint_dir: the directory of the checkpoint (``checkpoint_dir/preemption.pt``),
        visible to the chief; keep it for this job only. The chief checks it when the
        handler is made: created (mode 700) if missing, a directory, writable (a probe file
        is written and removed), and writable by no other user; every replica then raises
        the same error for a directory that fails.
      termination_config: a `TerminationConfig`; None: SIGTERM, ``sys.exit(42)``, no grace
        period.

    Making the handler is a collective (the chief reads the checkpoint, if any, and sends
    it to the other replicas): every replica makes it at the same point, after the process
    group exists (after the strategy is made). It watches for a termination notice from
    then on (signal handlers are installed in the main thread). `restored` tells whether
    it restored a checkpoint; `path` is the checkpoint file.

    A save that fails on any replica (the chief's write, or a `save_fn` raising) is
    recorded in the rendezvous store; every replica then raises a RuntimeError with that
    reason within a fraction of a second instead of exiting for a restart. A replica that
    waits for the chief (or the chief for the replicas) stops waiting when a signal comes
    after the notice, such as torchrun's SIGTERM stopping the group.

    What it does is logged at WARNING on the "torchstrategy" logger (the notice, the agreed
    step, the save, the exit); while the program has configured no logging, those lines go
    to stderr.

    Raises:
      TypeError / ValueError / NotImplementedError: bad arguments, named.
      NotADirectoryError / PermissionError: a `checkpoint_dir` that fails the checks above.
      KeyError: a checkpoint without one of the names of `checkpoint`.
      ValueError: a checkpoint written with another global batch size, or by a different
        number of replicas when this run's global batch does not divide evenly.
      RuntimeError: a checkpoint that is truncated or corrupt, not a preemption checkpoint,
        or does not fit the objects (another model's), naming the file and the fix.
    """

    def __init__(self, cluster_resolver: ClusterResolver | None, checkpoint: Mapping[str, Any],
                 checkpoint_dir: str | os.PathLike[str],
                 termination_config: TerminationConfig | None = None) -> None:
        _check_resolver(cluster_resolver)
        _check_objects(checkpoint)
        if checkpoint_dir is None or not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise TypeError(f"PreemptionCheckpointHandler: checkpoint_dir must be a directory "
                            f"path, got {checkpoint_dir!r}.")
        if termination_config is None:
            termination_config = TerminationConfig()
        if not isinstance(termination_config, TerminationConfig):
            raise TypeError(f"PreemptionCheckpointHandler: termination_config must be a "
                            f"ts.TerminationConfig or None, got {termination_config!r}.")
        install_default_log_handler()
        self._resolver = cluster_resolver
        self._objects = dict(checkpoint)
        self._dir = os.path.abspath(os.fspath(checkpoint_dir))
        self._config = termination_config
        self._exit_fn = termination_config.exit_fn or exit_for_restart
        self._grace = float(termination_config.grace_period or 0)
        self._timeout = world_lib.timeout_seconds()
        # The replicas that save together, over the communicator of the strategy that owns
        # the objects (`peers_of`); the chief reads and writes the checkpoint.
        self._extended = owning_extended(*self._objects.values())
        self._peers = peers_of(self._extended)
        self._is_chief = self._peers.is_chief
        self._run_calls = 0
        self._round = 0                 # 0: first agreed save; 1: the grace period's last
        self._target: tuple[int, bool] | None = None    # (step, final) agreed for this round
        self._claimed: bool | None = None   # None: not tried; True: this replica leads
        self._deadline: float | None = None   # when the leader calls the final save
        self._done = False
        self._step_seconds = 0.0
        self._save_seconds = 0.0
        self._signals_at_target = 0     # signals seen when this round's step was agreed
        self.restored = False
        # A new attempt: a restart marker of the previous one (launch/restart_marker.py) no
        # longer holds.
        restart_marker.clear_marker()
        nonce = self._restore()
        self._agreement: StoreAgreement | LocalAgreement
        if self._peers.world_size > 1:
            store = _compat.default_store()
            if store is None:
                raise RuntimeError("PreemptionCheckpointHandler needs the rendezvous store "
                                   "of the default process group, which has none.")
            self._agreement = StoreAgreement(store, nonce, self._peers.rank,
                                             self._peers.world_size)
        else:
            self._agreement = LocalAgreement()
        self._watcher = Watcher(termination_config)
        self._watcher.start()

    # -- restoring -------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The checkpoint file."""
        return os.path.join(self._dir, CHECKPOINT_FILE)

    def _read(self) -> tuple[Any, str]:
        """The chief's (payload or None, nonce) on every replica; every replica raises the
        chief's error when it could not check the directory or read the checkpoint (none
        is left waiting in a collective)."""
        def read() -> tuple[Any, str]:
            try:
                _check_directory(self._dir)
                remove_stale_temporaries(self._dir)  # left by a save killed midway
                payload = self._load() if os.path.exists(self.path) else None
            except (NotADirectoryError, PermissionError, RuntimeError):
                raise
            except Exception as caught:
                raise RuntimeError(f"PreemptionCheckpointHandler could not read the "
                                   f"checkpoint in {self._dir} (on the chief): "
                                   f"{_first_line(caught)}") from caught
            return payload, secrets.token_hex(8)
        with self._peers.explained("PreemptionCheckpointHandler's read of the checkpoint"):
            return self._peers.run_on_chief(read)

    def _load(self) -> Any:
        """The chief: the checkpoint file's contents, or a RuntimeError naming the file and
        the fix."""
        afresh = ("delete it to start afresh (training then starts from step 0), or put "
                  "back a complete copy")
        try:
            # weights_only: tensors and plain values; a planted pickle runs nothing.
            payload = torch.load(self.path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as caught:
            raise RuntimeError(f"The preemption checkpoint {self.path} holds objects other "
                               f"than tensors and plain values and was not loaded "
                               f"({str(caught).splitlines()[0]}); delete it to start "
                               "afresh.") from None
        except OSError as caught:
            if caught.errno in (errno.EACCES, errno.EPERM):
                raise RuntimeError(f"The preemption checkpoint {self.path} cannot be read "
                                   f"by this process ({caught.strerror}); make it readable "
                                   "(`chmod u+r`) or point the handler at another "
                                   "directory.") from None
            raise RuntimeError(f"The preemption checkpoint {self.path} is truncated or "
                               f"corrupt ({_first_line(caught)}); {afresh}.") from None
        except Exception as caught:
            # An empty file (EOFError), a cut zip ("failed finding central directory"):
            # the handler's own writes are atomic, so a copy or a full disk did this.
            raise RuntimeError(f"The preemption checkpoint {self.path} is truncated or "
                               f"corrupt ({_first_line(caught)}); {afresh}.") from None
        if not (isinstance(payload, dict) and "total_run_calls" in payload
                and "objects" in payload):
            raise RuntimeError(f"{self.path} is not a preemption checkpoint written by "
                               "ts.PreemptionCheckpointHandler (it lacks total_run_calls / "
                               "objects); delete it or point the handler at another "
                               "directory.")
        return payload

    def _restore(self) -> str:
        payload, nonce = self._read()
        if payload is None:
            return nonce
        objects = payload["objects"]
        if objects is not None:
            missing = [name for name in self._objects if name not in objects]
            if missing:
                raise KeyError(f"The preemption checkpoint {self.path} has no state for "
                               f"{missing} (it holds {sorted(objects)}). Give the same names "
                               "as the run that wrote it, or delete it to start afresh.")
        batches = payload.get("global_batch_sizes", {})
        check_resize(payload.get("num_replicas"), self._peers.world_size,
                     {name: (batches.get(name), global_batch_size(obj))
                      for name, obj in self._objects.items()
                      if batches.get(name) is not None or global_batch_size(obj) is not None},
                     f"The preemption checkpoint {self.path}")
        if objects is not None:
            for name, obj in self._objects.items():
                try:
                    self._extended.load_state_dict_from_checkpoint(obj, objects[name])
                except Exception as caught:  # torch's "size mismatch", "Missing key(s)"
                    raise RuntimeError(
                        f"The preemption checkpoint {self.path} does not fit "
                        f"checkpoint[{name!r}] ({_first_line(caught)}; "
                        f"{_mismatch(caught)}): it was written by another model or "
                        "configuration. Delete it to start afresh, or point the handler "
                        "at this job's own directory.") from caught
        rng = payload.get("rng") or {}
        if payload.get("num_replicas") == self._peers.world_size and self._peers.rank in rng:
            set_rng_state(rng[self._peers.rank])
        self._run_calls = int(payload["total_run_calls"])
        self.restored = True
        logger.warning(f"torchstrategy: restored the preemption checkpoint {self.path} "
                       f"(after {self._run_calls} steps).")
        return nonce

    # -- the public surface ------------------------------------------------------------
    @property
    def total_run_calls(self) -> int:
        """Steps run so far (`run` calls plus `save_checkpoint_if_preempted` calls),
        including those before a restart: the step to resume from."""
        return self._run_calls

    def run(self, distributed_train_function: Callable[..., Any], *args: Any,
            **kwargs: Any) -> Any:
        """Runs one training step, ``distributed_train_function(*args, **kwargs)``, and
        returns its result; before it, saves and exits if the replicas agreed to stop after
        the steps already run.

        Call it once per step on every replica, with a function that runs one step
        (``strategy.run`` inside: each step must hold a collective of every replica, which
        is what lets the replicas agree without one). If the function raises, the first
        replica's error is recorded in the store, and a replica failing afterwards (its
        collective broken by the first one's exit) raises an error naming it.
        """
        self._check_and_maybe_save((), {})
        started = time.monotonic()
        with self._reporting_errors():
            result = distributed_train_function(*args, **kwargs)
        self._run_calls += 1
        elapsed = time.monotonic() - started
        # The mean step time, which the grace period's countdown budgets with.
        self._step_seconds += (elapsed - self._step_seconds) / max(self._run_calls, 1)
        return result

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """Counts one step finished and saves (then exits) if the replicas agreed to stop
        after it: for loops that run steps themselves. Call it after every step.

        Args:
          *args, **kwargs: passed to the `TerminationConfig`'s `save_fn`.

        Raises:
          TypeError: arguments given without a `save_fn` to take them.
        """
        if (args or kwargs) and self._config.save_fn is None:
            raise TypeError("save_checkpoint_if_preempted: arguments are passed to "
                            "TerminationConfig.save_fn, and there is none; call it without "
                            "arguments.")
        self._run_calls += 1
        self._check_and_maybe_save(args, kwargs)

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """A block in which termination notices are watched and errors are shared.

        Watching starts when the handler is made; at the end of this block it stops (the
        previous signal handlers are back), so that work after training (evaluation,
        export) sees SIGTERM as usual. Entering the block again resumes watching. An error
        raised in the block is recorded for the other replicas, as `run` does.
        """
        self._watcher.start()
        try:
            with self._reporting_errors():
                yield
        finally:
            self._watcher.stop()

    # -- the agreement --------------------------------------------------------------
    def _check_and_maybe_save(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._done:
            return
        if self._target is None:
            self._target = self._agreement.agreed(self._round)
            if self._target is None and self._watcher.notice.is_set():
                self._lead()
            if self._target is None:
                return
            self._signals_at_target = self._watcher.signals_received
            logger.warning(f"torchstrategy: replica {self._peers.rank}: the replicas agreed to save "
                           f"the preemption checkpoint after step {self._target[0]} "
                           f"(this replica has run {self._run_calls})"
                           + ("." if self._target[1] else "; training goes on after it, "
                              "in the grace period."))
        step, final = self._target
        if self._run_calls < step:
            return
        if self._run_calls > step:
            raise RuntimeError(
                f"PreemptionCheckpointHandler: the replicas agreed to save after step {step}, "
                f"but this replica had already run {self._run_calls} steps. Every step run "
                "through the handler must hold a collective of all replicas (strategy.run "
                "with a gradient all-reduce) and every replica must call run() (or "
                "save_checkpoint_if_preempted()) once per step.")
        self._save(args, kwargs)
        if final:
            self._finish()
        else:
            self._round += 1
            self._target = None
            logger.warning("torchstrategy: preemption checkpoint saved; training goes on "
                           "during the grace period.")

    def _lead(self) -> None:
        """This replica has a notice and no step is agreed in this round: the first one to
        claim publishes the step after the next."""
        if self._claimed is None:
            self._claimed = self._agreement.claim()
        if not self._claimed:
            return  # another replica leads; its step will be published
        now = time.monotonic()
        # The notice is set, so its time is known.
        noticed = self._watcher.notice_time if self._watcher.notice_time is not None else now
        if self._round == 0:
            remaining = noticed + self._grace - now
            final = remaining <= self._margin()
            if not final:
                self._deadline = noticed + self._grace
        elif self._deadline is not None and now < self._deadline - self._margin():
            return  # keep training in the grace period
        else:
            final = True
        step = self._run_calls + 1
        self._agreement.publish(self._round, step, final)
        self._target = (step, final)

    def _margin(self) -> float:
        return _GRACE_MARGIN * (2 * self._step_seconds + self._save_seconds)

    def _wait_bound(self) -> float:
        """How long to wait for a peer while saving: the time left of the grace period, or
        the collective timeout without one."""
        if self._grace > 0 and self._watcher.notice_time is not None:
            return max(self._watcher.notice_time + self._grace - time.monotonic(), 1.0)
        return self._timeout

    def _interrupted(self) -> bool:
        """A signal came after this round's step was agreed (torchrun's agent stopping the
        group, a second notice): a wait of the save ends at once."""
        return self._watcher.signals_received > self._signals_at_target

    def _save_failed(self, error: BaseException | str) -> PreemptionSaveError:
        """Records this replica's failure for the others (first one wins) and returns the
        error to raise, with the first reason."""
        if isinstance(error, BaseException):
            error = self._agreement.report_save_failure(
                self._round, f"replica {self._peers.rank}: {_first_line(error)}")
        logger.warning(f"torchstrategy: replica {self._peers.rank}: the preemption checkpoint was not "
                       f"saved ({error}); exiting with the error, not for a restart.")
        return PreemptionSaveError(
            f"PreemptionCheckpointHandler: the preemption checkpoint {self.path} was not "
            f"saved after step {self._run_calls}: {error}. Nothing was saved for this "
            "preemption, so this replica stops with this error instead of exiting for a "
            "restart (a restart would resume from the previous checkpoint, if any). Fix the "
            "cause (the directory's permissions or free space, or the save_fn).")

    def _save(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        started = time.monotonic()
        rng = rng_state()  # before save_fn, which might draw random numbers
        save_fn = self._config.save_fn
        try:
            if save_fn is not None:
                save_fn(*args, **kwargs)
            else:
                # Every replica takes part: a strategy that shards parameters (or
                # partitions optimizer state) gathers them here; the chief writes its result.
                states = {name: self._extended.state_dict_for_checkpoint(obj)
                          for name, obj in self._objects.items()}
        except Exception as error:
            raise self._save_failed(error) from error
        # Offered once this replica's part is done: the chief writes only after every part.
        self._agreement.offer_rng(self._round, rng)
        if self._is_chief:
            try:
                rngs = self._agreement.collect_rng(self._round, self._wait_bound(),
                                                   self._interrupted)
            except SaveFailedError as failed:
                raise self._save_failed(str(failed)) from None
            payload = {"format": _FORMAT, "total_run_calls": self._run_calls,
                       "num_replicas": self._peers.world_size, "rng": rngs,
                       "objects": None if save_fn is not None else states,
                       "global_batch_sizes": {name: global_batch_size(obj)
                                              for name, obj in self._objects.items()
                                              if global_batch_size(obj) is not None}}
            try:
                write_atomically(payload, self.path, directory_mode=0o700)
            except Exception as error:
                raise self._save_failed(error) from error
            self._agreement.mark_saved(self._round)
            logger.warning(f"torchstrategy: preemption checkpoint written to {self.path} "
                           f"after {self._run_calls} steps.")
        else:
            try:
                if self._agreement.wait_saved(self._round, self._wait_bound(),
                                              self._interrupted):
                    logger.warning(f"torchstrategy: replica {self._peers.rank}: the chief wrote the "
                                   f"preemption checkpoint {self.path} after "
                                   f"{self._run_calls} steps.")
            except SaveFailedError as failed:
                raise self._save_failed(str(failed)) from None
        self._save_seconds = time.monotonic() - started

    def _finish(self) -> None:
        self._done = True
        # The checkpoint is written: from here a signal acts as it did before the handler
        # (a replica stuck on its way out must not ignore the SIGTERM that torchrun's agent
        # sends to stop the group). If exit_fn returns, training goes on unwatched.
        self._watcher.stop()
        if self._config.exit_fn is None:
            logger.warning(f"torchstrategy: replica {self._peers.rank}: exiting with code "
                           f"{RESTART_EXIT_CODE} after the preemption checkpoint, for "
                           "torchrun or the scheduler to restart the job.")
        else:
            logger.warning(f"torchstrategy: replica {self._peers.rank}: calling "
                           "TerminationConfig.exit_fn after the preemption checkpoint.")
        # Tells a `requeue_exit` wrapper that this exit asks for a restart, whatever code
        # the launchers in between end with (torchrun: 1).
        restart_marker.write_marker(f"replica {self._peers.rank}: preemption checkpoint {self.path} "
                                    f"after {self._run_calls} steps")
        self._exit_fn()
        restart_marker.clear_marker()   # exit_fn returned: no restart was asked for

    @contextlib.contextmanager
    def _reporting_errors(self) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            if isinstance(self._agreement, LocalAgreement):
                raise
            mine = f"replica {self._peers.rank}: {type(error).__name__}: {error}"
            first = self._agreement.report_error(mine)
            if first != mine and not isinstance(error, PreemptionSaveError):
                raise RuntimeError(f"A step failed on another replica first ({first}); this "
                                   f"replica then failed with {type(error).__name__}.") \
                    from error
            raise

    def __repr__(self) -> str:
        return (f"PreemptionCheckpointHandler({self._dir!r}, total_run_calls="
                f"{self._run_calls}, objects={sorted(self._objects)})")
