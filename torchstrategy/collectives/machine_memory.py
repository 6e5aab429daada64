"""Shared memory among the replicas of one machine: the stages of `HierarchicalCopyAllReduce`
inside a machine without the local group's TCP connections.

Over gloo, the replicas of one machine otherwise sum and broadcast over loopback TCP: every
byte is copied into the kernel and out again, and both replicas' cores do the work of a
network stack. Through a segment of shared memory, a replica copies its piece in once, the
machine's leader adds it to its own, and the replicas copy the result out once. The
collectives of the local group still carry the order and the completion (a one-element
reduce says "my piece is in", a one-element broadcast "the result is out"), so the pipeline,
its timeouts and its errors are those of the TCP path.

The segment is a file in /dev/shm, created by the leader and mapped by every replica of the
machine, then unlinked at once: nothing is left behind, even by a crash, outside the few
milliseconds of the set-up. Where a replica cannot map it (no /dev/shm, another user, a
container with its own /dev/shm, too little space), every replica of the machine keeps the
TCP path, and the replica that could not logs why (INFO).

Layout: a header of per-slot sequence counters, then one region per replica of the machine,
each of `slots` slots of `slot_bytes`: region 0 holds the results (written by the leader),
region r > 0 the pieces of the machine's replica r. Piece number `seq` (counted alike on
every replica of the machine, in the order the pieces were handed over) uses slot
`seq % slots` of each region. Before a slot is written again, its previous piece must be
done with: a replica waits until the leader has added the previous piece of its slot
(`wait_consumed`), and the leader until every replica has copied out the previous result of
the slot (`wait_copied_out`); those waits are bounded by the collective timeout.
"""
from __future__ import annotations

import logging
import os
import secrets
import time

import torch
import torch.distributed as dist

logger = logging.getLogger("torchstrategy")

SHARED_MEMORY_DIR = "/dev/shm"
SLOTS = 8
_HEADER_ALIGN = 4096


class MachineMemory:
    """A mapped segment shared by the `local_size` replicas of one machine.

    Guarantees: `contribution(r, seq, piece)` and `result(seq, piece)` are views into the
    same bytes on every replica of the machine; the counters written by `mark_*` are seen
    by the `wait_*` of the others (aligned 8-byte stores and loads, ordered by the
    collectives that follow them).
    """

    def __init__(self, storage: torch.Tensor, local_rank: int, local_size: int,
                 slot_bytes: int, slots: int, timeout_seconds: float) -> None:
        self.local_rank = local_rank
        self.local_size = local_size
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._timeout_seconds = timeout_seconds
        self._storage = storage
        header_bytes = header_size(local_size, slots)
        # [token, consumed of each slot, copied out of each slot by each replica]
        self._header = storage[:header_bytes].view(torch.int64)
        self._region_start = header_bytes

    def _slot(self, region: int, seq: int, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"a piece of {nbytes} bytes does not fit a slot of "
                             f"{self.slot_bytes}")
        start = (self._region_start + (region * self.slots + seq % self.slots)
                 * self.slot_bytes)
        return self._storage[start:start + nbytes].view(like.dtype).view(like.shape)

    def contribution(self, local_rank: int, seq: int, like: torch.Tensor) -> torch.Tensor:
        """The slot where replica `local_rank` (> 0) puts piece `seq` (shaped as `like`)."""
        return self._slot(local_rank, seq, like)

    def result(self, seq: int, like: torch.Tensor) -> torch.Tensor:
        """The slot where the leader puts piece `seq`'s result."""
        return self._slot(0, seq, like)

    def _consumed_index(self, seq: int) -> int:
        return 1 + seq % self.slots

    def _copied_index(self, local_rank: int, seq: int) -> int:
        return 1 + self.slots * (1 + local_rank) + seq % self.slots

    def mark_consumed(self, seq: int) -> None:
        """Leader: every replica's piece `seq` has been added; its slots may be reused."""
        self._header[self._consumed_index(seq)] = seq + 1

    def mark_copied_out(self, seq: int) -> None:
        """This replica has copied piece `seq`'s result out; the leader may reuse the slot."""
        self._header[self._copied_index(self.local_rank, seq)] = seq + 1

    def wait_consumed(self, seq: int) -> None:
        """Before this replica writes piece `seq`: the leader is done with the slot's previous
        piece (number `seq - slots`)."""
        previous = seq - self.slots
        if previous >= 0:
            self._wait(self._consumed_index(previous), previous + 1,
                       "the machine's leader to add the piece before it in its slot")

    def wait_copied_out(self, seq: int) -> None:
        """Before the leader writes piece `seq`'s result: every replica of the machine has
        copied out the slot's previous result."""
        previous = seq - self.slots
        if previous >= 0:
            for rank in range(1, self.local_size):
                self._wait(self._copied_index(rank, previous), previous + 1,
                           f"local replica {rank} to copy out the result before it in its slot")

    def _wait(self, index: int, at_least: int, what: str) -> None:
        deadline = time.monotonic() + self._timeout_seconds
        pause = 20e-6
        while int(self._header[index]) < at_least:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"torchstrategy: HierarchicalCopyAllReduce waited {self._timeout_seconds:g}"
                    f" s (the collective timeout) for {what} in the machine's shared memory; "
                    "a replica of this machine has stopped or is stuck.")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    # -- the four moves of a piece, each with the wait that makes its slot safe ----------
    def put(self, seq: int, piece: torch.Tensor) -> None:
        """This replica (not the leader) puts `piece` as piece `seq`, once its slot is free."""
        self.wait_consumed(seq)
        self.contribution(self.local_rank, seq, piece).copy_(piece)

    def add_into(self, seq: int, piece: torch.Tensor) -> None:
        """Leader: adds the other replicas' piece `seq` to its own `piece`, in local rank
        order, and frees their slots."""
        for local_rank in range(1, self.local_size):
            piece.add_(self.contribution(local_rank, seq, piece))
        self.mark_consumed(seq)

    def publish(self, seq: int, piece: torch.Tensor) -> None:
        """Leader: writes `piece` as the result of piece `seq`, once its slot is free."""
        self.wait_copied_out(seq)
        self.result(seq, piece).copy_(piece)

    def take(self, seq: int, piece: torch.Tensor) -> None:
        """This replica (not the leader) copies the result of piece `seq` into `piece` and
        frees the slot."""
        piece.copy_(self.result(seq, piece))
        self.mark_copied_out(seq)


def header_size(local_size: int, slots: int) -> int:
    words = 1 + slots * (1 + local_size)
    return -(-words * 8 // _HEADER_ALIGN) * _HEADER_ALIGN


def segment_size(local_size: int, slots: int, slot_bytes: int) -> int:
    """Bytes of the segment: the header and one region per replica of the machine."""
    return header_size(local_size, slots) + local_size * slots * slot_bytes


def open_machine_memory(local_group: dist.ProcessGroup, leader: int, local_rank: int,
                        local_size: int, slot_bytes: int, timeout_seconds: float,
                        slots: int = SLOTS, directory: str = SHARED_MEMORY_DIR
                        ) -> MachineMemory | None:
    """Creates the machine's segment on its leader and maps it on every replica of the
    machine: a collective of `local_group` (whose global rank `leader` is the leader).

    Returns the mapping on every replica, or None on every replica where any of them could
    not map it (each replica that could not logs why); the file is unlinked before this
    returns either way.
    """
    size = segment_size(local_size, slots, slot_bytes)
    path: str | None = None
    storage: torch.Tensor | None = None
    problem = ""
    try:
        if local_rank == 0:
            try:
                path = os.path.join(directory,
                                    f"torchstrategy-{os.getpid()}-{secrets.token_hex(8)}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    # Reserves the pages now: a tmpfs too small fails here with ENOSPC,
                    # not later with a SIGBUS in the middle of a step.
                    os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
                storage = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                storage[:header_size(local_size, slots)].view(torch.int64).zero_()
                storage[:8].view(torch.int64)[0] = secrets.randbits(62) + 1
                message: list[object] = [(path, int(storage[:8].view(torch.int64)[0]))]
            except (OSError, RuntimeError) as error:
                problem = f"the leader could not create {size >> 20} MiB in {directory}: {error}"
                message = [None]
        else:
            message = [None]
        dist.broadcast_object_list(message, src=leader, group=local_group)
        offer = message[0]
        if local_rank != 0 and isinstance(offer, tuple):
            shared_path, token = str(offer[0]), int(offer[1])
            try:
                storage = torch.from_file(shared_path, shared=True, size=size,
                                          dtype=torch.uint8)
                if int(storage[:8].view(torch.int64)[0]) != token:
                    problem = "it maps another file under the same name"
                    storage = None
            except (OSError, RuntimeError) as error:
                problem = str(error)
                storage = None
        mapped = torch.tensor([0 if storage is None else 1], dtype=torch.int64)
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=local_group)
    finally:
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
    if int(mapped[0]) == 0:
        if problem:
            logger.info("HierarchicalCopyAllReduce: local replica %d of this machine keeps "
                        "the local group's TCP inside the machine: %s", local_rank, problem)
        return None
    assert storage is not None
    return MachineMemory(storage, local_rank, local_size, slot_bytes, slots, timeout_seconds)
