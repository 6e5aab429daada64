"""Live recovery: lose a replica (or a machine) mid-step, lose no step, keep training exact.

`LiveRecovery` runs each step of a data-parallel job so that the loss of replicas without
notice (SIGKILL, a crash, a machine gone) costs seconds and changes nothing in the result:

1. the replicas take their share of the *global* batch (`batch_split`);
2. when the step's first optimizer step is about to run (its gradients summed: a replica
   that reaches it completed its gradient all-reduce), every replica votes in the
   rendezvous store, from the optimizers' step pre-hook; the step commits on all replicas
   or on none (`step_commit`). On "commit" the optimizers step; on "abort" the hook stops
   the step there, before anything expensive changed, so only what changes before the
   vote is copied at the start of each step (buffers, gradients present, hyper-parameters,
   random state: `step_snapshot.StepStart`). Steps that cannot vote there (``commit_every``
   above 1, a step function that changes parameters without its optimizers or steps one
   again on new gradients after the vote, and the first step of each step function, where
   that is found out) copy the whole state instead and vote after the step
   (`step_snapshot.StepSnapshot`). With ``vote_every=n`` only every n-th step votes; in
   the others the completed all-reduce is the commit, and after a loss the survivors one
   step behind take the state of one ahead (`_catch_up`) instead of redoing the step;
3. when a replica is lost, its collective breaks on the survivors (gloo's connection
   closes at once), or its heartbeat stops while the others wait for its vote
   (`membership`) or while their step runs long (then each breaks its own end of the
   group's connections: `launch.sockets`; a link down closes nothing, and gloo's
   collective would wait for its timeout); the survivors put their state back, close
   their broken group (which breaks the collectives of the survivors still waiting in one),
   agree on who is alive, build a new process group among themselves in the same
   processes (`Runtime.regroup`, under a store prefix new for the generation), and redo the
   interrupted step on the same global batch split among them. N replicas still equal one
   device, through every loss.

Where it cannot recover, every survivor ends with the reason and exit code 42 (the code
`PreemptionCheckpointHandler` exits with, which torchrun, SLURM's ``RequeueExit=42`` and
the requeue wrapper read as "restart me"), so the scheduler's restart and
`BackupAndRestore` take over: the rendezvous store's host (the chief) lost or cut off
(a replica whose heartbeat the store has not answered for the collective timeout ends at
once), fewer survivors than ``min_replicas``, or a survivor that did not join the new
group in time (a second failure during the recovery).

The loop changes in one line: ``strategy.run(step, args=(batch,))`` becomes
``recovery.run(step, global_batch)``, on every replica with the same global batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Mapping, NoReturn, Sequence

import torch
import torch.distributed as dist

from torchstrategy import runtime
from torchstrategy.collectives.communicator import CollectiveError
from torchstrategy.fault_tolerance import termination
from torchstrategy.fault_tolerance.batch_split import check_divisible, replica_slice
from torchstrategy.fault_tolerance.membership import (Heartbeat, LivenessWatch, StoreLost,
                                                      agree_on_survivors, agreement_begun)
from torchstrategy.fault_tolerance.state_broadcast import broadcast_state
from torchstrategy.fault_tolerance.step_commit import (ABORT, COMMIT, COMMIT_AND_ADMIT,
                                                      COMMIT_AND_LEAVE, StepCommit,
                                                      joiners_key)
from torchstrategy.fault_tolerance.step_snapshot import StepSnapshot, StepStart
from torchstrategy.launch import rendezvous, sockets
from torchstrategy.launch import world as world_lib
from torchstrategy.strategies.base import Strategy
from torchstrategy.strategies.data_parallel import DataParallelExtended
from torchstrategy.strategies.parameters import ParameterHandling

logger = logging.getLogger("torchstrategy")

# Launchers that stop every replica when one dies: live recovery cannot run under them.
_ALL_OR_NOTHING_LAUNCHERS = {
    "launch": "ts.launch stops every replica when one dies",
    "reexec": "a re-executed `python train.py` (one machine, or TF_CONFIG) stops its "
              "machine's replicas when one dies",
}
# The rendezvous-store key naming the running job's live recovery (its token), read by joiners.
_JOB_KEY = "torchstrategy/live/job"
# Text of a collective broken by a lost replica when torch raises it without our wrapper.
_BROKEN_CONNECTION = ("connection reset", "connection closed", "connection refused",
                      "broken pipe", "timed out", "pair.cc")


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One recovery: from `step` (the first step redone), the replicas `lost` (their
    original ranks) left, `replicas` remained, and training went on `seconds` after the failure
    was noticed (the survivors' agreement and the new group; the redone step excluded)."""

    step: int
    lost: tuple[int, ...]
    replicas: int
    seconds: float
    planned: bool = False   # the replicas left on a termination notice (none was lost)


# How a step function's steps commit (`LiveRecovery._verdicts`): the vote in the first
# optimizer's step pre-hook with `StepStart`'s copy, or after the step with the full copy.
_VOTE_IN_STEP = "vote in the optimizer step's pre-hook"
_VOTE_AFTER_STEP = "vote after the step, against a full copy"


class _StepAborted(BaseException):
    """Raised in an optimizer's step pre-hook when the step's vote is "abort": unwinds the
    step function out of ``strategy.run`` before any optimizer steps (a BaseException, so
    that a step function's ``except Exception`` does not stop it)."""


def _function_key(fn: Callable[..., Any]) -> str:
    """A name for a step function that is the same on every replica and for every closure
    made from the same code (the verdict on how it commits is kept by it)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        code = getattr(getattr(fn, "__func__", None), "__code__", None)
    if code is not None:
        return f"{code.co_filename}:{code.co_firstlineno}:{code.co_name}"
    return f"{type(fn).__module__}.{type(fn).__qualname__}"


@dataclasses.dataclass(frozen=True)
class _RunningStep:
    """A step in progress, as the heartbeat's thread sees it: when it began, the other
    members it needs, the sockets of the process group it runs on, and the store prefix
    of the agreement that follows a failure of that group."""

    began: float
    others: tuple[int, ...]
    group_sockets: frozenset[str]
    next_agreement: str


class _AdmissionBroken(RuntimeError):
    """The group of the members and the joiners admitted at a commit could not be built: a
    joiner (or a member) died during the admission."""


class LiveRecoveryError(RuntimeError):
    """A replica's step raised an error that is not a lost replica (a bug, bad data): every
    replica raises it instead of recovering."""


def _lost_replica(error: BaseException) -> bool:
    """Whether `error`, raised by a step, is a collective broken by a replica that died (as
    opposed to an error of the program)."""
    if isinstance(error, (CollectiveError, dist.DistError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(t in text for t in _BROKEN_CONNECTION)


def _admission_broke(error: BaseException) -> bool:
    """Whether `error`, raised while members and joiners regroup or share the state, is a
    replica (or joiner) lost during the admission, rather than an error of the program."""
    return isinstance(error, _AdmissionBroken) or _lost_replica(error)


def _drop_frames(error: BaseException) -> None:
    """Lets go of the frames of `error`'s tracebacks (and of the errors chained to it): they
    reference the broken process group, whose connections must close when it is abandoned,
    so that a replica still blocked in a collective with this one fails at once (it waited
    seconds otherwise: measured 12 s after an admission whose joiner died)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


def _cannot_regroup(extended: DataParallelExtended) -> str:
    """Why `extended` cannot continue on a regrouped set of replicas ("" if it can)."""
    handling = type(extended.parameters)
    if handling.rebuild_after_regroup is ParameterHandling.rebuild_after_regroup:
        return (f"{handling.__name__} (its parameters are not mirrored: ShardedStrategy's "
                "shards live on the lost replicas too); use BackupAndRestore")
    ops = extended.communicator.cross_device_ops
    if getattr(ops, "create_groups", None) is not None:
        return (f"{type(ops).__name__}, whose per-machine groups hold the original "
                "replicas; use the default cross_device_ops")
    compression = getattr(ops, "compression", None)
    if compression is not None and not isinstance(compression, str):
        return (f"compression={compression!r}, whose error-feedback state is kept per "
                "replica and would be lost with them; use no compression or a cast "
                "(\"bf16\", \"fp16\")")
    return ""


class LiveRecovery:
    """Runs the steps of `strategy` so that lost replicas are replaced by a regrouping of
    the survivors in the same processes, without losing or repeating a step (see the module
    docstring).

    Args:
      strategy: a `MultiWorkerMirroredStrategy` (or `MirroredStrategy`) whose replicas are
        each started by a launcher that lets the others live on when one dies: srun, one
        ``torchrun`` per machine (``--max-restarts=0``), or a cluster manager's processes.
      objects: name -> model or optimizer: everything the step changes (put back when a
        step does not commit).
      global_batch_size: the samples of every global batch given to `run`; every replica
        count from `min_replicas` to the job's must divide it.
      min_replicas: below this many survivors the job ends with exit code 42 instead.
      failure_detection_seconds: a replica whose heartbeat has not moved for this long,
        while the others wait for it, is taken for lost (heartbeats every 0.2 s).
      recovery_timeout_seconds: bound on the survivors' agreement and on building their new
        group; beyond it the job ends with exit code 42.
      commit_every: steps per commit. 1 (the default): the replicas vote in every step,
        once its gradients are summed and before its optimizers step (only buffers,
        gradients present, hyper-parameters and random state are copied), and a loss
        redoes the interrupted step only. k: the whole state is copied and the replicas
        vote every k steps (the copy's cost divided by k); a loss redoes the steps since
        the last commit (at most k), and `commit` must be called at the end of training and
        before the state is read. Gradient accumulation across calls of `run` under
        ``no_sync()`` needs k = the micro-batches per optimizer step (the accumulated
        gradients of a lost replica are lost with it; redoing the micro-batches since the
        last optimizer step restores them).
      vote_every: with ``commit_every=1``, the steps per vote (default 1: a vote in every
        step). With n > 1 only every n-th step votes (joiners are admitted and departures
        carried out there); in the others a replica whose gradient all-reduce completed
        applies the step at once, with no request to the store. A loss in such a step can
        leave survivors one step apart (some completed the all-reduce before the loss, some
        did not): once regrouped, those behind receive the state of one ahead (as a joiner
        does) instead of redoing the step, so that every survivor has applied it once. The
        vote's cost per step is divided by n; a termination notice or a joiner waits up to n
        steps. Needs ``commit_every=1``.
      leave_on_signals: signals (e.g. ``(signal.SIGTERM,)``: a spot notice, the preemption
        of one node) on which this replica leaves the job at the next commit while the
        others go on (a planned departure: nothing is redone); it then exits with 0. Where
        the departures would leave fewer than `min_replicas`, every replica exits with 42
        instead. Default: none (signals keep their handlers, e.g. a
        `PreemptionCheckpointHandler`'s job-wide save).
      max_replicas: the most replicas the job may grow to by admitting joiners (default:
        its size at the start, i.e. it only shrinks); `global_batch_size` must divide by
        every size from `min_replicas` to it. A joiner takes the job's value with its
        admission: pass none there, or the job's (another value is refused).
      join: the rendezvous store's address (host, port) of a running job to join, for a
        process whose strategy has one replica: it is admitted at the job's next commit,
        receives the parameters, optimizer state, the step and the random state from
        replica 0, and returns from here as one of the job's replicas.
      exit_fn: called (on each survivor, in the main thread) when recovery is impossible;
        default ``sys.exit(42)``. A replica cut off from the rendezvous store (no heartbeat
        answered for the collective timeout: its machine's link or the chief's machine
        down) ends with ``os._exit(42)`` from the heartbeat's thread instead, after the
        reason is logged: its main thread may be blocked in a request to the store that
        TCP abandons only many minutes later.

    Raises:
      TypeError: a strategy that does not keep one replica per process in a data-parallel
        group, whose parameters are sharded (ShardedStrategy), whose cross-device ops keep
        sub-groups (HierarchicalCopyAllReduce) or per-replica compression state
        (PowerSGD, Int8); objects that are not modules or optimizers.
      ValueError: a global batch that some replica count from `min_replicas` to the job's
        does not divide (naming them), a bad `min_replicas`, or a launcher that stops every
        replica when one dies.
    """

    def __init__(self, strategy: Strategy, objects: Mapping[str, Any], *,
                 global_batch_size: int, min_replicas: int = 1,
                 failure_detection_seconds: float = 2.0,
                 recovery_timeout_seconds: float = 60.0, commit_every: int = 1,
                 vote_every: int = 1,
                 leave_on_signals: Sequence[int] = (), max_replicas: int | None = None,
                 join: tuple[str, int] | None = None,
                 exit_fn: Callable[[], Any] | None = None) -> None:
        extended = strategy.extended
        if not isinstance(extended, DataParallelExtended):
            raise TypeError(f"LiveRecovery needs a MultiWorkerMirroredStrategy or "
                            f"MirroredStrategy, got {type(strategy).__name__}.")
        refusal = _cannot_regroup(extended)
        if refusal:
            raise TypeError(f"torchstrategy: live recovery cannot run with {refusal}.")
        world = runtime.current().world
        size = extended.communicator.world_size
        if join is not None and size != 1:
            raise ValueError(f"join= is for a process whose strategy has one replica (the "
                             f"joiner), not {size}: make the joiner's strategy on a plain "
                             "process, without the job's RANK / WORLD_SIZE.")
        largest = size if max_replicas is None else max_replicas
        if join is not None and max_replicas is None:
            # A joiner (often the job's own program started again) takes the job's bound
            # from the store below; until then the job's min_replicas is allowed here.
            largest = max(size, min_replicas)
        if isinstance(largest, bool) or not isinstance(largest, int) or largest < size:
            raise ValueError(f"max_replicas must be an int of at least the job's {size} "
                             f"replicas, got {max_replicas!r}.")
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or \
                not 1 <= min_replicas <= largest:
            raise ValueError(f"min_replicas must be an int from 1 to the job's {largest} "
                             f"replicas, got {min_replicas!r}.")
        check_divisible(global_batch_size, range(min_replicas, largest + 1))
        if world is not None and size > 1 and world.launcher in _ALL_OR_NOTHING_LAUNCHERS \
                and join is None:
            raise ValueError(
                f"torchstrategy: live recovery cannot run here: "
                f"{_ALL_OR_NOTHING_LAUNCHERS[world.launcher]}. Start each replica with a "
                "launcher that lets the others live on: srun, one torchrun per machine "
                "(--max-restarts=0), or one process per replica (RANK, WORLD_SIZE, "
                "MASTER_ADDR, MASTER_PORT).")
        self._strategy = strategy
        self._extended = extended
        self._snapshot = StepSnapshot(objects)
        self._step_start = StepStart(objects)
        self._modules = [o for o in objects.values() if isinstance(o, torch.nn.Module)]
        self._optimizers = [o for o in objects.values()
                            if isinstance(o, torch.optim.Optimizer)]
        self._global_batch_size = global_batch_size
        self._min_replicas = min_replicas
        self._dead_after = float(failure_detection_seconds)
        self._recovery_timeout = float(recovery_timeout_seconds)
        self._exit_fn = exit_fn or termination.exit_for_restart
        self._timeout = world_lib.timeout_seconds(
            getattr(getattr(strategy, "communication_options", None), "timeout_seconds",
                    None))
        self._uid = extended.communicator.rank   # the original rank: a replica's name
        self._members = list(range(size))
        self._generation = 0
        if isinstance(commit_every, bool) or not isinstance(commit_every, int) or \
                commit_every < 1:
            raise ValueError(f"commit_every must be a positive int, got {commit_every!r}.")
        self._commit_every = commit_every
        if isinstance(vote_every, bool) or not isinstance(vote_every, int) or vote_every < 1:
            raise ValueError(f"vote_every must be a positive int, got {vote_every!r}.")
        if vote_every > 1 and commit_every != 1:
            raise ValueError(f"vote_every={vote_every} needs commit_every=1 (with "
                             f"commit_every={commit_every} the replicas vote every "
                             f"{commit_every} steps already); pass one of them.")
        self._vote_every = vote_every
        # Step function -> how its steps commit (_VOTE_IN_STEP or _VOTE_AFTER_STEP), found
        # by its first step; the same on every replica (a joiner receives them).
        self._verdicts: dict[str, str] = {}
        # The step being run: whether the optimizers' pre-hook votes in it (`_armed`), its
        # decision once voted, the optimizers stepped since, why it could not vote in the
        # step (found while probing: the first step of a step function).
        self._armed = False
        self._probing = False
        self._outcome: str | None = None
        self._leaving = False
        self._stepped_after_vote: list[torch.optim.Optimizer] = []
        self._cannot_vote_in_step = ""
        self._grads_at_vote: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._hook_handles: list[Any] = []
        self._departures = ""
        # The signal that asked this replica to leave, once one came.
        self._notice: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._ended = False
        # The steps run since the last commit (function, global batch), redone after a
        # loss; the committed steps before them; the commits so far (the vote's key).
        self._window: list[tuple[Callable[..., Any], Any]] = []
        self._committed = 0
        self._commits = 0
        #: The number of steps run (the index of the step running, inside a step).
        self.step = 0
        self.recoveries: list[Recovery] = []
        self._heartbeat: Heartbeat | None = None
        # The step in progress (set by the main thread) and, in the heartbeat's thread, the
        # watch on the others' heartbeats once it runs long, and the step whose group it
        # broke (see `_watch_step`).
        self._running: _RunningStep | None = None
        # Held by the heartbeat's thread while it breaks the running step's group, and by
        # the main thread while it ends a step: a step that ended is never broken.
        self._running_lock = threading.Lock()
        self._stall: tuple[_RunningStep, LivenessWatch] | None = None
        self._broken_step: _RunningStep | None = None
        self._store: dist.Store | None = None
        # Joiners admitted so far (their uids follow the job's first ranks).
        self._admitted = 0
        self._max_replicas = largest
        self._joined_now: list[int] = []
        if size == 1 and join is None:
            return
        assert world is not None
        timeout = datetime.timedelta(seconds=self._timeout)
        if join is not None:
            host, port = join
            world = dataclasses.replace(world, master_addr=host, master_port=int(port))
            self._store = rendezvous.connect(host, int(port), 1, timeout)
            self._store.wait([_JOB_KEY], timeout)
            token = self._store.get(_JOB_KEY).decode()
        else:
            assert world.master_port, "a world of several replicas"
            # A prefix new for this job's recovery, the same on every replica: replica 0's.
            token = extended.communicator.broadcast_object(uuid.uuid4().hex)
        self._world = world
        self._prefix = f"torchstrategy/live/{token}/"
        # On the replica that hosts the rendezvous store (torch's env:// makes rank 0 its
        # server), the server lives as long as something references it: the default group
        # does, and it is destroyed by a recovery. This reference keeps it serving.
        self._hosted_store = runtime.current().rendezvous_store()
        # Connections of our own to the rendezvous store: one for this thread, one for the
        # heartbeat thread (the group's own is destroyed with the group).
        if self._store is None:
            self._store = rendezvous.connect(world.master_addr, world.master_port, size,
                                             timeout)
        settings_key = f"{self._prefix}settings"
        if join is not None:
            job_settings = json.loads(self._store.get(settings_key))
            # The job's bound, which this joiner votes by once admitted.
            largest = job_settings["max_replicas"]
            if max_replicas is not None and max_replicas != largest:
                raise ValueError(f"max_replicas={max_replicas} differs from the job's "
                                 f"({largest}): pass the job's value, or none (a joiner "
                                 "then takes the job's).")
            self._max_replicas = largest
            # Which steps vote must be the same on every replica: a replica that votes
            # where the others do not would wait for votes that never come.
            for name, mine in (("commit_every", commit_every), ("vote_every", vote_every)):
                job = job_settings[name]
                if mine != job:
                    raise ValueError(f"{name}={mine} differs from the job's ({job}): a "
                                     f"joiner votes at the job's steps; pass {name}={job}.")
            # A joiner's name: after the job's first ranks and the joiners before it.
            ticket = int(self._store.add(joiners_key(self._prefix), 1))
            self._uid = int(self._store.get(f"{self._prefix}size")) + ticket - 1
            self._members = []
        elif world.rank == 0:
            self._store.set(f"{self._prefix}size", str(size))
            self._store.set(settings_key, json.dumps(
                {"max_replicas": self._max_replicas, "commit_every": commit_every,
                 "vote_every": vote_every}))
            self._store.set(_JOB_KEY, token)
        self._heartbeat = Heartbeat(
            rendezvous.connect(world.master_addr, world.master_port, size, timeout),
            self._prefix, self._uid, unreachable_after=self._timeout,
            on_unreachable=self._cut_off, on_beat=self._watch_step)
        self._commit = self._new_commit()
        # Registered last: after any hook the optimizer already had (e.g. a strategy's).
        self._hook_handles = [optimizer.register_step_pre_hook(self._before_optimizer_step)
                              for optimizer in self._optimizers]
        if leave_on_signals:
            if threading.current_thread() is not threading.main_thread():
                raise ValueError("leave_on_signals needs the LiveRecovery to be made in the "
                                 "main thread (where Python runs signal handlers).")
            for signum in leave_on_signals:
                self._previous_handlers[signum] = signal.signal(signum, self._on_notice)
        # The roll call that names missing replicas after a failed collective takes seconds;
        # here the survivors name the lost replicas themselves, once they agreed.
        extended.communicator.diagnose = None
        runtime.current().on_shutdown(f"torchstrategy.live_recovery.{token}", self._finish)
        termination.install_default_log_handler()
        if join is not None:
            self._wait_for_admission(ticket)

    # -- the step --------------------------------------------------------------------------
    @property
    def uid(self) -> int:
        """This replica's name in the job, kept through regroupings: its rank when the job
        started; joiners are numbered after the job's first replicas, in their order."""
        return self._uid

    @property
    def num_replicas(self) -> int:
        """The replicas training now (the job's, less those lost)."""
        return self._extended.communicator.world_size

    @property
    def joiners_waiting(self) -> int:
        """The processes that asked to join the job (``join=``) and are not admitted yet:
        they are admitted at the job's next commit, as many as `max_replicas` leaves room
        for. One request to the rendezvous store; 0 for a job of one replica."""
        if self._store is None:
            return 0
        return int(self._store.add(joiners_key(self._prefix), 0)) - self._admitted

    def run(self, fn: Callable[..., Any], global_batch: Any) -> Any:
        """Runs ``strategy.run(fn, args=(share,))``, `share` being this replica's share of
        `global_batch` (the same global batch on every replica), and returns its result.

        With ``commit_every=1`` (the default) the step has committed on every replica when
        this returns: the replicas voted when its first optimizer step was about to run
        (or, for a step function that cannot vote there, after it ran). With
        ``commit_every=k`` every k-th call commits the k steps since the last commit (call
        `commit` at the end of training and before reading the state). Steps interrupted
        by lost replicas are undone and redone among the survivors on the same global
        batches before this returns. A step that committed and then lost a replica in a
        collective after its optimizers stepped (a metric's all-reduce) is not redone:
        the survivors regroup and this returns None for it.

        A step function whose optimizers vote in their pre-hook must change the parameters
        only through the optimizers given to LiveRecovery, once each per step; the first
        step of each step function checks it (under a full copy of the state), and one that
        does not keeps voting after the step, against a full copy (logged once).

        Raises:
          LiveRecoveryError: a replica's step raised an error of the program (re-raised
            there as it is).
          ValueError: a batch whose leaves do not have `global_batch_size` rows.
          SystemExit(42): recovery impossible (through `exit_fn`).
        """
        if self._store is None:   # one replica: nothing to recover
            result = self._strategy.run(fn, args=(global_batch,))
            self.step += 1
            return result
        if self._commit_every == 1:
            return self._run_step(fn, global_batch)
        if not self._window:
            self._snapshot.take()
        self._window.append((fn, global_batch))
        return self._complete(boundary=len(self._window) >= self._commit_every)

    def commit(self) -> None:
        """Commits the steps run since the last commit (with ``commit_every`` > 1), redoing
        them among the survivors if replicas were lost meanwhile. Every replica calls it at
        the same point: at the end of training, and before the state is read (saved,
        evaluated). Nothing to do with ``commit_every=1``."""
        if self._store is not None and self._window:
            self._complete(boundary=True)

    # -- commit_every=1: the vote in the optimizers' step pre-hook ----------------------------
    def _run_step(self, fn: Callable[..., Any], global_batch: Any) -> Any:
        """Runs one step until it commits (redone among the survivors after a loss) and
        returns its result; see `run`."""
        assert self._store is not None
        key = _function_key(fn)
        self._window = [(fn, global_batch)]
        while True:
            verdict = self._verdicts.get(key)
            self._probing = verdict is None
            in_step = verdict != _VOTE_AFTER_STEP
            full_copy = self._probing or not in_step
            if full_copy:
                self._snapshot.take()
            else:
                self._step_start.take()
            self._outcome = None
            self._leaving = False
            self._stepped_after_vote = []
            self._cannot_vote_in_step = ""
            self._grads_at_vote = []
            self.step = self._committed
            comm = self._extended.communicator
            share = replica_slice(global_batch, comm.rank, comm.world_size,
                                  self._global_batch_size)
            failure: BaseException | None = None
            aborted = False
            result: Any = None
            self._armed = in_step
            try:
                with self._watched():
                    result = self._strategy.run(fn, args=(share,))
            except _StepAborted:
                aborted = True
            except Exception as error:
                if not _lost_replica(error):
                    self._report_error(error)
                    raise
                failure = error
            finally:
                self._armed = False
            outcome = ABORT if aborted else self._outcome
            if outcome is None:
                # No optimizer stepped in the step (or it votes after the step): vote now.
                outcome = self._vote(ran=failure is None)
                if self._probing and failure is None and self._snapshot.parameters_changed():
                    self._cannot_vote_in_step = ("it changes parameters without stepping an "
                                                 "optimizer given to LiveRecovery")
            if outcome != ABORT:
                self._committed += 1
                self._commits += 1
                self._window = []
                self.step = self._committed
                self._settle_verdict(key, in_step)
                if failure is not None:
                    self._after_committed_failure(failure, outcome)
                    return None
                if outcome == COMMIT_AND_LEAVE:
                    self._depart(self._departures, self._leaving)
                elif outcome.startswith(COMMIT_AND_ADMIT):
                    self._admit(int(outcome[len(COMMIT_AND_ADMIT):]))
                return result
            self._check_error_reported()
            if full_copy:
                self._snapshot.restore()
            else:
                self._step_start.restore()
            attempted = self._committed
            self.step = self._committed
            self._regroup(failure)
            if self._committed > attempted:
                # Another survivor had applied this step: its state was received instead.
                self._window = []
                return None

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any,
                               kwargs: Any) -> None:
        """The optimizers' step pre-hook: at the first optimizer step of a step (its
        gradients summed), the vote; "abort" stops the step here (`_StepAborted`)."""
        del args, kwargs
        if not self._armed:
            return None
        if self._outcome is None:
            if self._probing and self._snapshot.parameters_changed():
                self._cannot_vote_in_step = "it changes parameters before its first " \
                                            "optimizer step"
            if self._probing or (self._commits + 1) % self._vote_every == 0:
                self._outcome = self._vote(ran=True)
            else:
                # This replica's all-reduce completed: it applies the step; a survivor
                # whose all-reduce did not is brought to this state after a loss
                # (`_catch_up`).
                self._outcome = COMMIT
            if self._outcome == ABORT:
                raise _StepAborted()
            if self._probing:   # the gradients the vote was cast on (a copy, once)
                self._grads_at_vote = [(p, None if p.grad is None else p.grad.detach().clone())
                                       for p in self._step_start.parameters]
            self._stepped_after_vote = [optimizer]
            return None
        if any(o is optimizer for o in self._stepped_after_vote):
            self._cannot_vote_in_step = "it steps an optimizer more than once"
        elif self._probing:
            mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
            for param, voted in self._grads_at_vote:
                grad = param.grad
                if id(param) in mine and ((grad is None) != (voted is None) or (
                        grad is not None and voted is not None and
                        not torch.equal(grad.detach(), voted))):
                    self._cannot_vote_in_step = (
                        "it steps an optimizer on gradients computed after another "
                        "optimizer stepped")
                    break
        self._stepped_after_vote.append(optimizer)
        return None

    def _settle_verdict(self, key: str, in_step: bool) -> None:
        """After a committed step: how the steps of its function commit from now on."""
        if not in_step or (not self._probing and not self._cannot_vote_in_step):
            return
        if self._cannot_vote_in_step:
            self._verdicts[key] = _VOTE_AFTER_STEP
            logger.warning(
                f"torchstrategy: live recovery: the step function {key.rsplit(':', 1)[-1]!r} "
                f"votes after its steps, against a full copy of the state taken before each "
                f"one ({self._cannot_vote_in_step}): that copy costs about one pass of the "
                "optimizer over the state per step. Step each optimizer given to "
                "LiveRecovery once per step, and change the parameters only through them, "
                "for the vote before the optimizer step (no copy).")
        else:
            self._verdicts[key] = _VOTE_IN_STEP

    def _after_committed_failure(self, failure: BaseException, outcome: str) -> None:
        """A step committed (its optimizers stepped), then a collective after them broke:
        nothing to redo; the survivors regroup (a replica leaving at this commit leaves)."""
        self._check_error_reported()
        if outcome == COMMIT_AND_LEAVE and self._leaving:
            logger.warning(f"torchstrategy: live recovery: replica {self._uid} leaves the "
                           f"job after step {self._committed - 1} (termination notice).")
            self._close()
            runtime.current().abandon_process_group()
            raise SystemExit(0)
        if self._extended.communicator.rank == 0:
            logger.warning(
                f"torchstrategy: live recovery: step {self._committed - 1} committed, then a "
                f"collective after its optimizer step broke "
                f"({str(failure).splitlines()[0][:160]}); it is not redone (its result is "
                "None).")
        self._regroup(failure)

    def _vote(self, ran: bool) -> str:
        """This replica's vote on the step (or the steps since the last commit): `ran`,
        whether it ran to the vote; returns the decision (see `StepCommit.decide`)."""
        assert self._store is not None
        notice = self._notice
        leaving = ran and notice is not None
        self._departures = f"{self._prefix}gen{self._generation}/commit{self._commits}/leaving/"
        try:
            if leaving and notice is not None:
                self._store.set(f"{self._departures}{self._uid}", signal.Signals(notice).name)
            room = self._max_replicas - len(self._members)
            outcome = self._commit.decide(self._commits, ran, leaving,
                                          self._admitted if room > 0 else None, room)
        except (StoreLost, RuntimeError) as error:
            self._give_up(f"the rendezvous store stopped answering ({error}): the chief's "
                          "machine, which hosts it, is lost or unreachable from this one")
        self._leaving = leaving
        return outcome

    # -- commit_every=k: the vote after k steps, against a full copy ------------------------
    def _complete(self, boundary: bool) -> Any:
        """Runs the last step of the window (all of it again after a recovery) and, at a
        `boundary` or after a failure, the vote; returns the last step's result."""
        assert self._store is not None
        replay = False
        result: Any = None
        while True:
            failure: BaseException | None = None
            first = 0 if replay else len(self._window) - 1
            for index in range(first, len(self._window)):
                fn, global_batch = self._window[index]
                self.step = self._committed + index
                comm = self._extended.communicator
                share = replica_slice(global_batch, comm.rank, comm.world_size,
                                      self._global_batch_size)
                try:
                    with self._watched():
                        result = self._strategy.run(fn, args=(share,))
                except Exception as error:
                    if not _lost_replica(error):
                        self._report_error(error)
                        raise
                    failure = error
                    break
            if failure is None:
                self.step = self._committed + len(self._window)
                if not boundary:
                    return result
            outcome = self._vote(ran=failure is None)
            if outcome in (COMMIT, COMMIT_AND_LEAVE) or outcome.startswith(COMMIT_AND_ADMIT):
                self._committed += len(self._window)
                self._commits += 1
                self._window = []
                if outcome == COMMIT_AND_LEAVE:
                    self._depart(self._departures, self._leaving)
                elif outcome.startswith(COMMIT_AND_ADMIT):
                    self._admit(int(outcome[len(COMMIT_AND_ADMIT):]))
                return result
            self._check_error_reported()
            self._snapshot.restore()
            self.step = self._committed
            self._regroup(failure)
            replay = True

    def _report_error(self, error: BaseException) -> None:
        """Tells the others that this replica's step failed by an error of the program: they
        raise too instead of recovering."""
        assert self._store is not None
        try:
            self._store.compare_set(f"{self._prefix}error", "",
                                    f"replica {self._uid}: {type(error).__name__}: "
                                    f"{str(error)[:500]}")
            self._store.compare_set(f"{self._prefix}gen{self._generation}/step"
                                    f"{self._commits}/decision", "", ABORT)
        except Exception:  # the store is gone: the others find out by themselves
            pass

    def _check_error_reported(self) -> None:
        assert self._store is not None
        try:
            if self._store.check([f"{self._prefix}error"]):
                raise LiveRecoveryError(
                    "torchstrategy: the step failed on another replica with an error of the "
                    f"program, not a lost replica: {self._store.get(f'{self._prefix}error').decode()}")
        except LiveRecoveryError:
            raise
        except Exception:
            pass

    # -- the recovery ----------------------------------------------------------------------
    def _new_commit(self) -> StepCommit:
        assert self._store is not None
        return StepCommit(self._store, f"{self._prefix}gen{self._generation}/",
                          self._members, self._prefix, self._dead_after)

    def _admit(self, joiners: int) -> None:
        """After a commit that admits the joiners up to number `joiners`: tells them the new
        members, regroups with them and gives them the state (`_share_state`)."""
        assert self._store is not None
        size0 = int(self._store.get(f"{self._prefix}size"))
        new = [size0 + t - 1 for t in range(self._admitted + 1, joiners + 1)]
        members = self._members + new
        note = json.dumps({"generation": self._generation + 1, "members": members,
                           "admitted": joiners})
        for uid in new:
            self._store.set(f"{self._prefix}admitted/{uid}", note)
        self._admitted = joiners
        broken = ""
        try:
            self._regroup(None, members, joined=new)
            if self._joined_now:
                self._share_state()
        except Exception as error:
            if not _admission_broke(error):
                raise
            # Only its text is kept (see `_drop_frames`).
            broken = str(error).splitlines()[0][:160]
        if broken:
            # A joiner (or a member) died during the admission. The step before it
            # committed everywhere and the members' states are equal, so the members
            # regroup among themselves as after a loss between steps (nothing to redo);
            # no joiner of this admission is admitted (the living ones end, see
            # `_wait_for_admission`, and may ask again).
            logger.warning(f"torchstrategy: live recovery: the admission of joiner(s) {new} "
                           f"broke ({broken}); the members regroup without them.")
            self._joined_now = []
            self._members = [m for m in self._members if m not in new]
            self._regroup(RuntimeError(broken))

    def _wait_for_admission(self, ticket: int) -> None:
        """The joiner's side of `_admit`: waits (up to the collective timeout) for the job to
        admit it, then regroups with the job's replicas and takes replica 0's state."""
        assert self._store is not None
        key = f"{self._prefix}admitted/{self._uid}"
        self._store.wait([key], datetime.timedelta(seconds=self._timeout))
        note = json.loads(self._store.get(key))
        self._generation = note["generation"] - 1
        self._admitted = note["admitted"]
        try:
            self._regroup(None, note["members"], joined=[self._uid])
            self._share_state()
        except Exception as error:
            if not _admission_broke(error):
                raise
            self._give_up(f"its admission broke ({str(error).splitlines()[0][:160]}): a "
                          "replica or another joiner died meanwhile, and the members go on "
                          "without this admission's joiners; start it again to ask anew")

    def _catch_up(self) -> None:
        """After a loss with ``vote_every`` > 1 (a collective of the new group): the
        survivors compare the steps they applied; where they differ (by one step: a step's
        all-reduce completed on some before the loss), those behind receive the state of
        the first one ahead (`_share_state`) and take its step counters, keeping their own
        random state."""
        comm = self._extended.communicator
        applied = comm.gather_objects(self._committed)
        ahead = max(applied)
        if min(applied) == ahead:
            return
        source = applied.index(ahead)
        if comm.rank == 0:
            behind = [self._members[r] for r, n in enumerate(applied) if n < ahead]
            logger.warning(f"torchstrategy: live recovery: replica(s) {behind} had not "
                           f"applied step {ahead - 1}, which replica "
                           f"{self._members[source]} had (its all-reduce completed before "
                           "the loss): they take its state instead of redoing the step.")
        self._share_state(source, adopt=self._committed < ahead, adopt_random_state=False)

    def _share_state(self, src: int = 0, adopt: bool | None = None,
                     adopt_random_state: bool = True) -> None:
        """Replica `src`'s parameters, buffers, optimizer state, step counters and random
        state on every replica of the new group (a collective: after an admission, or to
        catch up after a loss). The counters (and, with `adopt_random_state`, the random
        state) are taken where `adopt` (default: by the joiners just admitted)."""
        comm = self._extended.communicator
        tensors: list[torch.Tensor] = [t for m in self._modules
                                       for t in [*m.parameters(), *m.buffers()]]
        with torch.no_grad():
            comm.broadcast_(tensors, src=src)
        for optimizer in self._optimizers:
            state = broadcast_state(comm, optimizer.state_dict() if comm.rank == src
                                    else None, src=src)
            if comm.rank != src:
                optimizer.load_state_dict(state)
        counters = comm.broadcast_object(
            (self._committed, self._commits, torch.get_rng_state(), self._verdicts)
            if comm.rank == src else None, src=src)
        if adopt is None:
            adopt = self._uid in self._joined_now
        if adopt:
            self._committed, self._commits, rng, verdicts = counters
            self._verdicts = dict(verdicts)
            self.step = self._committed
            if adopt_random_state:
                torch.set_rng_state(rng)
        self._joined_now = []

    def _on_notice(self, signum: int, frame: Any) -> None:
        del frame
        self._notice = signum

    def _depart(self, departures: str, leaving: bool) -> None:
        """After a commit some replicas leave (`leaving`: this one): it ends with exit code
        0, the others regroup without it; where fewer than `min_replicas` would remain,
        every replica ends with 42."""
        assert self._store is not None
        leavers = [m for m in self._members if self._store.check([f"{departures}{m}"])]
        staying = [m for m in self._members if m not in leavers]
        if len(staying) < self._min_replicas:
            self._give_up(f"replica(s) {leavers} leave (a termination notice), which leaves "
                          f"{len(staying)} replica(s), fewer than "
                          f"min_replicas={self._min_replicas}")
        if leaving:
            logger.warning(f"torchstrategy: live recovery: replica {self._uid} leaves the "
                           f"job after step {self._committed - 1} (termination notice); "
                           f"{len(staying)} replica(s) go on without it.")
            self._close()
            runtime.current().abandon_process_group()
            raise SystemExit(0)
        self._regroup(None, staying)

    def _regroup(self, failure: BaseException | None,
                 expected: list[int] | None = None, joined: Sequence[int] = ()) -> None:
        """After a step that did not commit (or, with `expected`, after replicas left at a
        commit): the survivors agree on who they are, build a new group and continue as
        its replicas (see the module docstring)."""
        assert self._store is not None
        noticed = time.monotonic()
        process = runtime.current()
        if failure is not None:
            _drop_frames(failure)
        # Our end of the broken group closes now: a survivor still blocked in a collective
        # with us fails at once instead of at its timeout.
        process.abandon_process_group()
        generation = self._generation + 1
        prefix = f"{self._prefix}gen{generation}/"
        info = json.dumps([self._world.node_rank, socket.gethostname()])
        try:
            survivors = agree_on_survivors(self._store, prefix, self._prefix, self._uid,
                                           expected or self._members, self._dead_after,
                                           noticed + self._recovery_timeout, info)
        except StoreLost as error:
            self._give_up(f"the rendezvous store stopped answering ({error}): the chief's "
                          "machine, which hosts it, is lost or unreachable from this one")
        except TimeoutError as error:
            self._give_up(f"the survivors could not agree within "
                          f"{self._recovery_timeout:g} s: {error}")
        lost = tuple(m for m in self._members if m not in survivors)
        # Joiners that died before they registered for the new group are not admitted.
        admission = bool(joined)
        gone = [u for u in joined if u not in survivors]
        joined = [u for u in joined if u in survivors]
        if self._uid not in survivors:
            self._give_up("the other replicas counted this one as lost (its heartbeat "
                          "stalled) and continued without it")
        if len(survivors) < self._min_replicas:
            self._give_up(f"{len(survivors)} replica(s) survive the loss of replica(s) "
                          f"{list(lost)}, fewer than min_replicas={self._min_replicas}")
        world = self._survivors_world(prefix, survivors)
        store = dist.PrefixStore(f"{prefix}group/", self._store)
        store.set_timeout(datetime.timedelta(seconds=self._recovery_timeout))
        try:
            process.regroup(world, self._extended.communicator.backend, store, self._timeout)
        except Exception as error:  # gloo's and the store's errors alike
            if joined:
                # This generation's survivors are decided: the members regroup again
                # under the next one.
                self._generation = generation
                raise _AdmissionBroken(str(error).splitlines()[0][:200]) from error
            self._give_up(f"a second failure during the recovery: the survivors {survivors} "
                          f"could not build their new group "
                          f"({str(error).splitlines()[0][:200]})")
        # After an admission every replica builds its reducer for the same parameters in
        # the same order (a joiner has none yet).
        self._extended.continue_on_regrouped_world(
            world, [p for m in self._modules for p in m.parameters() if p.requires_grad]
            if joined else None)
        self._joined_now = list(joined)
        self._members = survivors
        self._generation = generation
        self._commit = self._new_commit()
        if self._vote_every > 1 and not joined and not admission:
            self._catch_up()
        seconds = time.monotonic() - noticed
        if not admission:
            self.recoveries.append(Recovery(self.step, lost, len(survivors), seconds,
                                            planned=expected is not None))
        if world.rank == 0:
            cause = "" if failure is None else f" ({str(failure).splitlines()[0][:160]})"
            if admission:
                what = f"replica(s) {joined} admitted (joiner(s) {joined})" if joined else \
                    "no joiner admitted"
                if gone:
                    what += f", joiner(s) {gone} lost before they regrouped"
            elif expected:
                what = f"replica(s) {list(lost)} left at a commit (termination notice)"
            else:
                what = f"replica(s) {list(lost)} lost{cause}" if lost else \
                    f"no member lost{cause}"
            last = self._committed + len(self._window) - 1
            redo = f"redo step(s) {self.step}..{last} on the same global batches" \
                if self._window else f"go on from step {self._committed}"
            logger.warning(f"torchstrategy: live recovery: {what}; {len(survivors)} "
                           f"replica(s) regrouped in {seconds:.2f} s and {redo}.")

    def _survivors_world(self, prefix: str, survivors: list[int]) -> world_lib.World:
        """This replica's place among `survivors` (their machines read from what each
        registered)."""
        assert self._store is not None
        machines = {}
        for uid in survivors:
            node, _host = json.loads(self._store.get(f"{prefix}alive/{uid}"))
            machines[uid] = node
        nodes = sorted(set(machines.values()))
        mine = machines[self._uid]
        on_my_machine = [u for u in survivors if machines[u] == mine]
        return dataclasses.replace(
            self._world, rank=survivors.index(self._uid), world_size=len(survivors),
            local_rank=on_my_machine.index(self._uid), local_world_size=len(on_my_machine),
            node_rank=nodes.index(mine), num_nodes=len(nodes), store=None)

    def _log_ending(self, reason: str) -> None:
        logger.error(f"torchstrategy: live recovery cannot continue on replica {self._uid}: "
                     f"{reason}. Exiting with code {termination.RESTART_EXIT_CODE} for the "
                     "scheduler to restart the job (BackupAndRestore resumes it).")

    def _give_up(self, reason: str) -> NoReturn:
        """Ends this replica: the reason, then `exit_fn` (exit code 42)."""
        self._log_ending(reason)
        self._close()
        try:
            runtime.current().abandon_process_group()
        except Exception:  # a broken group: nothing more to release
            pass
        self._exit_fn()
        raise RuntimeError(f"torchstrategy: live recovery cannot continue: {reason}")

    @contextlib.contextmanager
    def _watched(self) -> Iterator[None]:
        """Marks a step in progress for the heartbeat's thread (`_watch_step`). Only a gloo
        group's sockets are ever broken: NCCL's are its bootstrap's and its proxy's, whose
        loss may abort the process, and NCCL's own watchdog ends a stalled collective."""
        gloo = self._extended.communicator.backend == "gloo"
        self._running = _RunningStep(time.monotonic(),
                                     tuple(m for m in self._members if m != self._uid),
                                     runtime.current().group_sockets() if gloo
                                     else frozenset(),
                                     f"{self._prefix}gen{self._generation + 1}/")
        try:
            yield
        finally:
            with self._running_lock:
                if self._broken_step is self._running:
                    runtime.current().interrupt_gradient_reductions(False)
                self._running = None

    def _watch_step(self, store: dist.Store) -> None:
        """After each heartbeat (in its thread, over its connection `store`): when the step
        in progress has run for `failure_detection_seconds`, reads the other members'
        heartbeats and whether one of them has begun the agreement that follows a failure;
        once one has stopped beating for that long, or has begun that agreement, shuts down
        the sockets of the step's process group.

        A replica that crashed closes its connections, and the others' collective fails at
        once; one whose link went down (or which froze) closes nothing, and the others
        would wait in gloo's collective, which nothing interrupts, until the collective
        timeout. A member that has begun the agreement has abandoned the group, so no
        collective of it can complete any more, yet its closed end does not always end
        this one's collective: seen under load, a survivor sat in a gloo ring's receive
        for the whole collective timeout while the two others waited for it in the
        agreement, and shutting down its own sockets did not wake it either. So, besides
        breaking our own end (which makes a collective blocked on a silent peer fail), the
        reducers' wait for the gradient all-reduce is interrupted
        (`Runtime.interrupt_gradient_reductions`) and fails as a broken connection; the
        survivors recover as after a crash. A step that is merely slow (its members
        beating, none recovering) is left alone."""
        running = self._running
        if running is None or not running.others or not running.group_sockets or \
                time.monotonic() - running.began < self._dead_after or \
                self._broken_step is running:
            return
        if self._stall is None or self._stall[0] is not running:
            self._stall = (running, LivenessWatch(store, self._prefix, running.others,
                                                  self._dead_after))
        dead = self._stall[1].dead()
        recovering = not dead and agreement_begun(store, running.next_agreement)
        if not (dead or recovering):
            return
        with self._running_lock:
            if self._running is not running:
                return
            self._broken_step = running
            closed = sockets.shut_down(running.group_sockets)
            # A collective does not always fail when its sockets are shut down: the wait
            # for the gradient all-reduce gives up by itself.
            runtime.current().interrupt_gradient_reductions(True)
        waited = f"{time.monotonic() - running.began:.1f}"
        cause = f"replica(s) {dead} stopped beating" if dead else \
            "another replica's step failed and it has begun the recovery"
        logger.warning(f"torchstrategy: live recovery: {cause} while replica {self._uid} "
                       f"waited {waited} s in step {self.step}; {closed} connection(s) of "
                       f"the step's group broken to recover now rather than at the "
                       f"collective timeout ({self._timeout:g} s).")

    def _cut_off(self, silent: float) -> None:
        """The heartbeat's watch: the store has not answered for `silent` seconds (the
        collective timeout). Ends the process at once with exit code 42; see `exit_fn`."""
        if self._ended:
            return
        self._ended = True
        self._log_ending(f"the rendezvous store has not answered for {silent:.0f} s (the "
                         "collective timeout): this machine is cut off from the chief's, "
                         "which hosts it (a link down), or the chief's machine is down; the "
                         "other replicas go on without this one if they can")
        for handler in [*logger.handlers, *logging.getLogger().handlers]:
            handler.flush()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed stream: nothing to flush
                pass
        os._exit(termination.RESTART_EXIT_CODE)

    def _close(self) -> None:
        """Stops the heartbeat and gives the signals their handlers back; this replica takes
        no further part (nothing to wait for at exit)."""
        self._ended = True
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        if self._heartbeat is not None:
            self._heartbeat.stop()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def _finish(self) -> None:
        """At exit: the replicas leave together, so that the chief (which hosts the store)
        does not end while another still reads its last step's decision."""
        if self._store is None or self._heartbeat is None or self._ended:
            return
        self._close()
        if self._heartbeat.lost.is_set():
            return
        key = f"{self._prefix}gen{self._generation}/finished"
        deadline = time.monotonic() + 10.0
        try:
            self._store.add(key, 1)
            while int(self._store.add(key, 0)) < len(self._members) and \
                    time.monotonic() < deadline:
                time.sleep(0.02)
            # The chief's server then serves until every replica has stopped asking: a
            # replica whose last poll found the server gone would print torch's C++ stack.
            self._store.add(f"{key}/left", 1)
            if self._uid == 0:
                while int(self._store.add(f"{key}/left", 0)) < len(self._members) and \
                        time.monotonic() < deadline:
                    time.sleep(0.02)
        except Exception:  # the store is gone: nobody left to wait for
            pass
        # Our store connections (and, on the chief, the server) end here, before the
        # interpreter's teardown, where freeing them can block.
        self._store = self._hosted_store = None
        self._heartbeat = None
