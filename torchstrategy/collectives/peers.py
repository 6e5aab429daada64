"""Who this replica's peers are, and the few agreements that checkpoint code needs of them.

Checkpointing (``ts.checkpoint``, ``BackupAndRestore``, ``PreemptionCheckpointHandler``, a
sharded strategy's state) needs the same handful of things from the other replicas: this
replica's rank, how many there are, whether it is the chief, the chief's object on every
replica, every replica's object on the chief, and two ways of failing together:

- `Peers.agree`: every replica reports its outcome (an exception or None) and every replica
  raises the first replica's exception, or none does. Nothing is half done: a replica that
  found no problem does not go on into a collective the others will never join.
- `Peers.run_on_chief`: the chief runs a function (a read, a write); its result, or its
  exception, reaches every replica, which returns that result or raises that exception.

Both send the exception itself (pickled, as ``broadcast_object_list`` sends any object), so
a replica raises the class the chief raised, with its message: there is no table of
exception classes to keep up to date. An exception that cannot be pickled, or whose class
cannot be rebuilt from its pickle, travels as a ``RuntimeError`` naming its class and
message.

Everything goes through a `Communicator` (the strategy's, or one over the default process
group when the program checkpoints outside any strategy's scope), so every collective here
is bounded by the strategy's timeout and a failure names the replicas that stopped
answering. With one replica nothing is sent.
"""
from __future__ import annotations

import contextlib
import pickle
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from torchstrategy import runtime
from torchstrategy.collectives.communicator import Communicator, explained_failures
from torchstrategy.collectives.cross_device_ops import NcclAllReduce

T = TypeVar("T")

#: The replica that reads and writes checkpoints for everyone.
CHIEF = 0


class Peers:
    """This replica and the others it checkpoints with, over `communicator`.

    Every method that communicates is a collective: every replica calls it at the same
    point of the program.
    """

    def __init__(self, communicator: Communicator) -> None:
        self.communicator = communicator

    @property
    def rank(self) -> int:
        """This replica's index, 0 to ``world_size - 1``."""
        return self.communicator.rank

    @property
    def world_size(self) -> int:
        """The number of replicas (1: alone, nothing is ever sent)."""
        return self.communicator.world_size

    @property
    def is_chief(self) -> bool:
        """True on the replica that reads and writes for everyone (replica 0)."""
        return self.rank == CHIEF

    @property
    def device(self) -> torch.device:
        """The device this replica's collectives use (a CUDA device under NCCL)."""
        return self.communicator.device

    def explained(self, what: str) -> contextlib.AbstractContextManager[None]:
        """A context in which a failed collective is re-raised as a ``CollectiveError``
        saying that `what` failed, and naming the replicas that stopped answering."""
        return explained_failures(what, self.rank, self.communicator.diagnose)

    def broadcast(self, obj: Any) -> Any:
        """The chief's `obj` (small, picklable) on every replica."""
        return self.communicator.broadcast_object(obj, src=CHIEF)

    def gather_to_chief(self, obj: Any) -> list[Any] | None:
        """Every replica's `obj` (small, picklable) on the chief, in replica order; None on
        the other replicas."""
        gathered = self.communicator.gather_objects(obj)
        return gathered if self.is_chief else None

    def barrier(self) -> None:
        """Waits until every replica has reached this point (bounded by the timeout)."""
        self.communicator.barrier()

    def agree(self, error: BaseException | None, name_finder: bool = False) -> None:
        """All or nothing: returns on every replica when no replica passed an error; raises
        on every replica the error of the first replica (lowest rank) that passed one.

        Args:
          error: this replica's failure, or None.
          name_finder: add " (found by replica R)" to the message when there are several
            replicas (a problem one replica's files or state showed).

        Raises:
          The first failure (its class and message; see the module docstring).
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        outcomes = self.communicator.gather_objects(_transportable(error))
        for rank, outcome in enumerate(outcomes):
            if outcome is None:
                continue
            if rank == self.rank and error is not None and not name_finder:
                raise error
            raised = _rebuilt(outcome)
            if name_finder:
                _add_to_message(raised, f" (found by replica {rank})")
            raise raised

    def run_on_chief(self, fn: Callable[[], T]) -> T:
        """Calls `fn` on the chief alone and returns its result on every replica (the result
        must be picklable when there are several replicas); if `fn` raises, every replica
        raises that exception (the chief its own, with its traceback).

        `fn` may raise anything, a KeyboardInterrupt included: the other replicas are told
        before it propagates, so none is left waiting.
        """
        if self.world_size == 1:
            return fn()
        result: Any = None
        error: BaseException | None = None
        if self.is_chief:
            try:
                result = fn()
            except BaseException as caught:  # the broadcast below must still be reached
                error = caught
        outcome = self.broadcast((_transportable(error), result if error is None else None))
        if error is not None:
            raise error
        if outcome[0] is not None:
            raise _rebuilt(outcome[0])
        return outcome[1]


def _transportable(error: BaseException | None) -> Any:
    """`error` pickled, or as (class name, message) when it cannot be sent or rebuilt."""
    if error is None:
        return None
    try:
        data = pickle.dumps(error)
        pickle.loads(data)  # a class whose __init__ takes other arguments fails here
        return data
    except Exception:
        return (type(error).__name__, str(error))


def _rebuilt(outcome: Any) -> BaseException:
    """The exception `_transportable` made travel."""
    if isinstance(outcome, bytes):
        # Sent by a replica of this same job over its own process group (the trust domain
        # of torch's broadcast_object_list, which unpickles too), never read from a file.
        rebuilt = pickle.loads(outcome)
        if isinstance(rebuilt, BaseException):
            return rebuilt
    kind, message = outcome
    return RuntimeError(f"{kind}: {message}")


def _add_to_message(error: BaseException, suffix: str) -> None:
    """Appends `suffix` to `error`'s message (its first argument, when a string)."""
    if error.args and isinstance(error.args[0], str):
        error.args = (error.args[0] + suffix,) + tuple(error.args[1:])
    else:
        error.args = (str(error) + suffix,)


def process_group_peers(diagnose: Callable[[int], str] | None = None) -> Peers:
    """The replicas of torch.distributed's default process group (one per process, the
    launched world), for checkpoint code running where the default strategy is active
    (outside every scope) while the process is one replica of several.

    Made once per default group and process (runtime state), over the group's backend:
    NCCL replicas use the current CUDA device. `diagnose` (the strategy's, to name the
    replicas that stopped answering) is used when the communicator is first made.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return alone()
    key = "torchstrategy.collectives.peers.process-group"
    current = runtime.current()
    cache = current.state(key, _ProcessGroupPeers)
    # Dropped before the group is destroyed at exit: kept, the reference would make the
    # group outlive its destruction into the interpreter's teardown (where gloo's threads
    # can abort the process).
    current.on_shutdown(key, cache.forget)
    return cache.peers(diagnose)


def alone() -> Peers:
    """One replica on its own: nothing is ever sent."""
    return Peers(Communicator(None, 0, 1, torch.device("cpu"), NcclAllReduce()))


class _ProcessGroupPeers:
    """The `Peers` of the current default process group, remade when the group is."""

    def __init__(self) -> None:
        self._group: Any = None
        self._peers: Peers | None = None

    def peers(self, diagnose: Callable[[int], str] | None) -> Peers:
        group = dist.group.WORLD
        if self._peers is None or self._group is not group:
            nccl = dist.get_backend() == "nccl" and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if nccl \
                else torch.device("cpu")
            self._peers = Peers(Communicator(None, dist.get_rank(), dist.get_world_size(),
                                             device, NcclAllReduce(), diagnose=diagnose))
            self._group = group
        return self._peers

    def forget(self) -> None:
        """Drops the group and its peers (remade if asked for again)."""
        self._group = None
        self._peers = None
