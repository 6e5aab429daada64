"""`HierarchicalCopyAllReduce`: reduce inside each machine, all-reduce across machines, broadcast.

On a cluster the links inside a machine (NVLink, shared memory) are much faster than the
network between machines. Reducing locally first sends one buffer per machine over the
network instead of one per replica:

1. inside each machine, every replica's buffer is summed onto the machine's first replica
   (its *leader*);
2. the leaders all-reduce the machine sums among themselves;
3. each leader broadcasts the total back to the replicas of its machine.

The three stages are pipelined over pieces of the buffer (`PIECE_BYTES`), so that the
network between machines and the links inside each machine are busy at the same time, and
across buffers (`_Stages`): the gradient reducer hands over one buffer per bucket, and the
next bucket's pieces follow the previous one's onto the link without waiting for its
broadcast, so the link does not idle between buckets.

With gloo (CPU replicas), stages 1 and 3 go through a segment of shared memory that the
replicas of a machine map (`machine_memory.py`): a replica copies its piece in, the leader
adds it to its own, the replicas copy the result out; the local group's collectives carry
only a one-element signal per piece, for order, completion and timeouts. Where the segment
cannot be made, that machine's replicas sum over the local group's TCP as before.

The subgroups (one per machine, plus one of the leaders) are created once, collectively on
every replica, when the multi-worker strategy is created (`create_groups`). Until then, and
whenever the layout has a single machine (or one replica per machine), the op is a plain
all-reduce over the group it is given.
"""
from __future__ import annotations

import collections
import datetime
import functools
import threading
from typing import Callable, Deque, Hashable, Sequence

import torch
import torch.distributed as dist

from torchstrategy import runtime
from torchstrategy.collectives.cross_device_ops import (CrossDeviceOps, Pending, _All, _Done,
                                                        wait_for)
from torchstrategy.collectives.machine_memory import MachineMemory, open_machine_memory


# The staged path splits a buffer into pieces of at most this many bytes and pipelines them:
# while one piece crosses between the machines, the next is still being summed inside its
# machine and the previous one is being broadcast back. The sums do not depend on it (each
# element is added in the same order whatever the piece it falls in).
PIECE_BYTES = 4 << 20

# How long a replica waits on the machine's shared memory for another replica of the
# machine when no collective timeout was given (torch's default for gloo groups).
DEFAULT_TIMEOUT_SECONDS = 1800.0


def _signal() -> torch.Tensor:
    """What the local group's collectives carry for a piece that goes through the shared
    memory: one value, saying only that the piece (or its result) is there."""
    return torch.zeros(1)


class _Piece:
    """One piece of a buffer in `_Stages`: the work its next stage waits for."""

    __slots__ = ("tensor", "reduced", "work", "buffer", "landed", "seq")

    def __init__(self, tensor: torch.Tensor, reduced: dist.Work, buffer: _Buffer,
                 seq: int | None) -> None:
        self.tensor = tensor
        # Its machine's sum (the local reduce), kept apart from `work`: the stage it is in
        # now (the reduce, then on leaders the all-reduce between machines, then the
        # broadcast), which the backend's thread may move on at any time.
        self.reduced = reduced
        self.work = reduced
        self.buffer = buffer
        self.landed = False   # (leaders) its machine's sum is in
        # Its number in the machine's shared memory, or None where it goes by the local
        # group's TCP (no shared memory, or not a CPU tensor).
        self.seq = seq


class _Stages:
    """The stages of every buffer handed over and not yet finished, across buffers: one
    pipeline for all of them, so that the buckets of a backward overlap (while one
    bucket's pieces cross between the machines, the next bucket's are being summed inside
    each machine and the previous one's broadcast back), and the link between the machines
    gets each piece as soon as its machine's sum is in, whatever bucket it belongs to and
    while backward still runs.

    Pieces move through the stages strictly in the order they were handed over (`add`).
    The leaders' group only ever carries the leaders' all-reduces, so a leader starts each
    as soon as its piece's local sum lands (from the reduce's completion callback, on the
    backend's thread, or from `finish`, whichever comes first), in that order. Every
    replica starts its machine group's broadcasts in that order too, and only in `finish`
    (so that each machine group sees its collectives in the same order on all of its
    members: gloo matches them by that order).
    """

    def __init__(self, layout: _Layout) -> None:
        # The layout's groups, not the layout itself (which holds this object): no cycle, so
        # the groups go when the layout is dropped at exit.
        self._leader = layout.leader
        self._local_group = layout.local_group
        self._cross_group = layout.cross_group
        self._is_leader = layout.is_leader
        self._memory = layout.memory
        self._next_seq = 0     # pieces through the shared memory so far (alike on the machine)
        # The reduces' callbacks run on the backend's threads: the queues are shared.
        self._lock = threading.Lock()
        # Pieces whose cross-machine all-reduce has not started (leaders only), and
        # pieces whose broadcast has not started.
        self._to_cross: Deque[_Piece] = collections.deque()
        self._to_broadcast: Deque[_Piece] = collections.deque()
        # Pieces whose broadcast has started and was not yet waited for (main thread only).
        self._to_finish: Deque[_Piece] = collections.deque()
        self._error: BaseException | None = None

    def add(self, pieces: Sequence[torch.Tensor]) -> _Buffer:
        """Starts the per-machine sums of `pieces` (one buffer) and returns its handle."""
        buffer = _Buffer(self, len(pieces))
        for tensor in pieces:
            seq = None
            sent = tensor
            if self._memory is not None and tensor.device.type == "cpu":
                seq, self._next_seq = self._next_seq, self._next_seq + 1
                # The piece goes through the shared memory; the reduce only says it is there.
                sent = _signal()
                if not self._is_leader:
                    self._memory.put(seq, tensor)
            piece = _Piece(tensor, dist.reduce(sent, dst=self._leader,
                                               group=self._local_group, async_op=True),
                           buffer, seq)
            with self._lock:
                (self._to_cross if self._is_leader else self._to_broadcast).append(piece)
            if self._is_leader:
                piece.work.get_future().then(functools.partial(self._on_reduced, piece))
        return buffer

    def _on_reduced(self, piece: _Piece, future: torch.futures.Future[object]) -> None:
        """The completion callback of `piece`'s reduce (leaders; the backend's thread).

        It runs with the GIL on the local group's worker thread, which holds none of its
        own queue's locks while it runs callbacks, and it starts a collective on another
        group: safe, because c10d's Python bindings release the GIL before a collective
        takes its group's queue lock (`py::call_guard<py::gil_scoped_release>` on every
        collective in torch/csrc/distributed/c10d/init.cpp), so this thread never holds the
        GIL while waiting for a lock that a worker thread holds while waiting for the GIL
        (the inversion csrc/reducer.h guards against in its own C++ calls)."""
        try:
            future.wait()                  # a failed sum crosses nothing
        except BaseException as error:
            self._error = error
            return
        self._landed(piece)

    def _landed(self, piece: _Piece) -> None:
        """Leaders: `piece`'s local sum is in; starts the all-reduce between machines of
        every piece at the head of the queue whose sum is in."""
        try:
            with self._lock:
                if not piece.landed and self._memory is not None and piece.seq is not None:
                    self._memory.add_into(piece.seq, piece.tensor)
                piece.landed = True
                while self._to_cross and self._to_cross[0].landed:
                    head = self._to_cross.popleft()
                    head.work = dist.all_reduce(head.tensor, group=self._cross_group,
                                                async_op=True)
                    self._to_broadcast.append(head)
        except BaseException as error:   # on the backend's thread: reported by `finish`
            self._error = error

    def finish(self, buffer: _Buffer, timeout: datetime.timedelta | None) -> None:
        """Drives the stages until every piece of `buffer` (and of each buffer handed over
        before it) has its broadcast started, then waits for those broadcasts, in the order
        they were started, up to `buffer`'s last piece.

        Broadcasts are waited for (and, through shared memory, copied out) in that global
        order, whatever buffer is finished first: the gradient reducer finishes its flags
        (handed over last) before its buckets, and the leader may be waiting for an earlier
        bucket's result to be copied out before it can reuse the slot for a later piece."""
        try:
            with self._lock:
                waiting = list(self._to_cross)
            # Leaders: every local sum in, every cross started. Only the local sums are
            # waited for here: a piece may cross the moment it lands, and waiting for its
            # cross would hold back every broadcast until the last piece had crossed.
            for piece in waiting:
                wait_for(piece.reduced, timeout)
                self._landed(piece)
            while buffer.unstarted:
                if self._error is not None:
                    raise self._error
                with self._lock:
                    head = self._to_broadcast.popleft() if self._to_broadcast else None
                if head is None:
                    raise RuntimeError("torchstrategy: a hierarchical all-reduce waited for "
                                       "after an earlier one failed; its group is unusable.")
                wait_for(head.work, timeout)
                sent = head.tensor
                if self._memory is not None and head.seq is not None:
                    sent = _signal()   # says the result is in the shared memory
                    if self._is_leader:
                        self._memory.publish(head.seq, head.tensor)
                head.work = dist.broadcast(sent, src=self._leader, group=self._local_group,
                                           async_op=True)
                self._to_finish.append(head)
                head.buffer.unstarted -= 1
            while buffer.unfinished:
                piece = self._to_finish.popleft()
                wait_for(piece.work, timeout)
                if self._memory is not None and piece.seq is not None and \
                        not self._is_leader:
                    self._memory.take(piece.seq, piece.tensor)
                piece.buffer.unfinished -= 1
        except BaseException:
            # A failed or timed-out stage: the group is unusable; forget what was queued so
            # that no later call waits on it.
            with self._lock:
                self._to_cross.clear()
                self._to_broadcast.clear()
                self._to_finish.clear()
            raise


class _Buffer:
    """The handle of one buffer in `_Stages`: done when its pieces' broadcasts have
    landed."""

    def __init__(self, stages: _Stages, num_pieces: int) -> None:
        self._stages = stages
        self.unstarted = num_pieces     # pieces whose broadcast has not started
        self.unfinished = num_pieces    # pieces whose broadcast was not waited for
        self._done = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done:
            self._stages.finish(self, timeout)
            self._done = True
        return True


class _Layout:
    """This replica's view of the machine layout: its machine's group and leader, and the
    leaders' group (only on leaders)."""

    def __init__(self, local_group: dist.ProcessGroup | None, leader: int | None,
                 cross_group: dist.ProcessGroup | None, is_leader: bool,
                 num_machines: int, memory: MachineMemory | None) -> None:
        self.local_group = local_group
        self.leader = leader
        self.cross_group = cross_group
        self.is_leader = is_leader
        self.num_machines = num_machines
        self.memory = memory
        self.stages = _Stages(self)


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Sums inside each machine, then across machines (one replica per machine), then
    broadcasts the result back inside each machine (TensorFlow's name and argument).

    Args:
      num_packs: the buffer is split into this many chunks, each reduced on its own, so that
        a large buffer's chunks can be in flight together.
      shared_memory: with gloo (CPU replicas), sum and broadcast inside each machine through
        a segment of shared memory that the machine's replicas map (`machine_memory.py`),
        instead of over the local group's loopback TCP; where a replica of the machine
        cannot map it, that machine keeps the TCP path and the reason is logged. False:
        always the local group's collectives. With NCCL it does nothing (CUDA tensors go by
        NCCL inside the machine).

    The result equals a plain all-reduce up to floating-point summation order.
    """

    def __init__(self, num_packs: int = 1, shared_memory: bool = True) -> None:
        if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 1:
            raise ValueError(f"num_packs must be a positive int, got {num_packs!r}.")
        if not isinstance(shared_memory, bool):
            raise TypeError(f"shared_memory must be True or False, got {shared_memory!r}.")
        self.num_packs = num_packs
        self.shared_memory = shared_memory
        self._layout: _Layout | None = None

    @property
    def num_machines(self) -> int:
        """Machines in the layout the groups were created for (1 before `create_groups`)."""
        return 1 if self._layout is None else self._layout.num_machines

    @property
    def uses_shared_memory(self) -> bool:
        """Whether this replica's machine sums through shared memory (see `shared_memory`)."""
        return self._layout is not None and self._layout.memory is not None

    def create_groups(self, machine_of_rank: Sequence[Hashable],
                      timeout_seconds: float | None = None) -> None:
        """Creates the per-machine groups and the leaders' group.

        A collective: every replica of the default process group calls it with the same
        `machine_of_rank` (a list: global rank -> machine id), e.g. from the strategy's
        constructor. Each machine's leader is its lowest rank.

        Raises:
          ValueError: `machine_of_rank` whose length is not the default group's size.
        """
        world_size = dist.get_world_size()
        if len(machine_of_rank) != world_size:
            raise ValueError(f"machine_of_rank has {len(machine_of_rank)} entries for "
                             f"{world_size} replicas.")
        machines = list(dict.fromkeys(machine_of_rank))  # in order of first appearance
        members = {m: [r for r, mm in enumerate(machine_of_rank) if mm == m] for m in machines}
        leaders = [members[m][0] for m in machines]
        if len(machines) == 1 or len(machines) == world_size:
            self._layout = None  # one level only: a plain all-reduce is the hierarchy
            return
        timeout = (None if timeout_seconds is None
                   else datetime.timedelta(seconds=float(timeout_seconds)))
        rank = dist.get_rank()
        local_group: dist.ProcessGroup | None = None
        leader: int | None = None
        # Every replica creates every group, in the same order (new_group is collective).
        for m in machines:
            group = dist.new_group(members[m], timeout=timeout)
            if rank in members[m]:
                local_group, leader = group, members[m][0]
        cross_group = dist.new_group(leaders, timeout=timeout)
        is_leader = rank == leader
        assert local_group is not None and leader is not None
        memory = None
        mine = members[machine_of_rank[rank]]
        # A machine with one replica has nothing to sum inside it: no segment.
        if self.shared_memory and dist.get_backend() == "gloo" and len(mine) > 1:
            memory = open_machine_memory(
                local_group, leader, mine.index(rank), len(mine), PIECE_BYTES,
                timeout_seconds=(DEFAULT_TIMEOUT_SECONDS if timeout_seconds is None
                                 else float(timeout_seconds)))
        self._layout = _Layout(local_group, leader, cross_group if is_leader else None,
                               is_leader, len(machines), memory)
        # Drop the subgroups before the process group is released at exit: groups still
        # referenced at interpreter teardown are destroyed in the wrong order.
        runtime.current().on_shutdown(f"hierarchical-groups-{id(self)}", self._forget_groups)

    def _forget_groups(self) -> None:
        self._layout = None

    def all_reduce_async(self, flat: torch.Tensor, group: dist.ProcessGroup | None
                         ) -> Pending:
        if dist.get_world_size(group) == 1:
            return _Done()
        layout = self._layout
        if layout is None or group not in (None, dist.group.WORLD):
            return self._packs(flat, lambda chunk: dist.all_reduce(chunk, group=group,
                                                                   async_op=True))
        return self._packs(flat, lambda chunk: self._hierarchical(chunk, layout))

    def _packs(self, flat: torch.Tensor, start: Callable[[torch.Tensor], Pending]) -> Pending:
        if self.num_packs == 1 or flat.numel() < self.num_packs:
            return start(flat)
        return _All([start(chunk) for chunk in torch.tensor_split(flat, self.num_packs)])

    @staticmethod
    def _hierarchical(chunk: torch.Tensor, layout: _Layout) -> Pending:
        piece = max(1, PIECE_BYTES // max(chunk.element_size(), 1))
        return layout.stages.add(torch.split(chunk.view(-1), piece))

    def __repr__(self) -> str:
        return (f"HierarchicalCopyAllReduce(num_packs={self.num_packs}, "
                f"shared_memory={self.shared_memory})")
