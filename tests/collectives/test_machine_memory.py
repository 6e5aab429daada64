"""HierarchicalCopyAllReduce inside a machine through shared memory (machine_memory.py).

4 real gloo replicas laid out as 2 "machines" of 2 (they share this machine's /dev/shm, as
the replicas of one machine do): the sums through shared memory equal a plain all-reduce
bit for bit (integer-valued data, so that no summation order can change a bit), with
buffers of several dtypes handed over together before any is waited for (and waited for in
order, then last first, as the gradient reducer does), one of them
with more pieces than the segment has slots (so slots are reused within one buffer and
across buffers); the same with shared_memory=False (the local group's TCP); no file is
left in /dev/shm. Where the segment cannot be made, every replica of the machine keeps the
TCP path; a replica waiting on a stopped one ends at the timeout with the reason; a
piece's result goes back inside its machine while later pieces still cross between machines.
"""
import glob
import logging
import threading
import time

import pytest
import torch
import torch.distributed as dist

import torchstrategy as ts
from tests.helpers.replicas import from_every_replica, launch
from torchstrategy.collectives import machine_memory
from torchstrategy.collectives.hierarchical import PIECE_BYTES
from torchstrategy.collectives.machine_memory import (MachineMemory, open_machine_memory,
                                                      segment_size)

# 2 machines of 2; and 3 replicas on one machine (two pieces added to the leader's, two
# replicas copying out) beside a machine of one (no segment: nothing to sum inside it).
LAYOUTS = {"2+2": [0, 0, 1, 1], "3+1": [0, 0, 0, 1]}
# (numel, dtype): the third has 9 pieces of PIECE_BYTES, more than the segment's slots.
SHAPES = [(1, torch.float32), (7, torch.float64),
          (machine_memory.SLOTS * PIECE_BYTES // 4 + 1000, torch.float32),
          (3 << 18, torch.float64), (33, torch.int64), (5000, torch.float32)]


def _buffers(rank):
    g = torch.Generator().manual_seed(rank)
    return [torch.randint(-1000, 1000, (n,), generator=g).to(dtype) for n, dtype in SHAPES]


def _files():
    return sorted(glob.glob(f"{machine_memory.SHARED_MEMORY_DIR}/torchstrategy-*"))


def _sums(shared_memory, machines):
    ts.MirroredStrategy()  # joins the launched world's default process group
    rank = dist.get_rank()
    ops = ts.HierarchicalCopyAllReduce(shared_memory=shared_memory)
    ops.create_groups(machines, timeout_seconds=60)
    results = []
    for round_ in range(3):      # the slots' counters go on across calls
        outs = [b.clone() for b in _buffers(rank)]
        handles = [ops.all_reduce_async(x, None) for x in outs]   # all in flight at once
        # Waited for in order, then last first (as the gradient reducer waits for its flags,
        # handed over last, before its buckets: the slots of the large buffer's pieces are
        # reused before the first buffers are waited for).
        for handle in (handles if round_ == 0 else handles[::-1]):
            handle.wait()
        results.append(outs)
    plain = []
    for b in _buffers(rank):
        dist.all_reduce(b)
        plain.append(b)
    same = all(torch.equal(x, y) for outs in results for x, y in zip(outs, plain))
    every = [None] * 4
    dist.all_gather_object(every, {"same": same, "shared": ops.uses_shared_memory,
                                   "files": _files(), "dtypes": [x.dtype for x in results[0]]})
    return every


@pytest.mark.parametrize("shared_memory,layout", [(True, "2+2"), (True, "3+1"), (False, "2+2")],
                         ids=["shared-memory-2+2", "shared-memory-3+1", "tcp-2+2"])
def test_hierarchical_sums_through_shared_memory_equal_a_plain_all_reduce(shared_memory,
                                                                          layout):
    machines = LAYOUTS[layout]
    before = _files()
    replicas = launch(_sums, shared_memory, machines, n=4)
    for rank, replica in enumerate(replicas):
        alone = machines.count(machines[rank]) == 1
        assert replica["shared"] is (shared_memory and not alone), rank
        assert replica["same"], rank
        assert replica["dtypes"] == [dtype for _, dtype in SHAPES], rank
        assert replica["files"] == before, rank   # the segment is unlinked once mapped
    assert _files() == before


# How long machine 1's leader holds back its last piece's all-reduce between the machines.
HELD_SECONDS = 1.0


class _HeldWork:
    """The all-reduce of a piece, started `HELD_SECONDS` late by a thread of its own."""

    def __init__(self, start):
        self._work = None
        self._thread = threading.Thread(target=self._start, args=(start,), daemon=True)
        self._thread.start()

    def _start(self, start):
        time.sleep(HELD_SECONDS)
        self._work = start()

    def wait(self, timeout=None):
        self._thread.join()
        return self._work.wait() if timeout is None else self._work.wait(timeout)


def _broadcast_while_crossing():
    """Machine 1's leader starts the last of 3 pieces' all-reduce between the machines
    `HELD_SECONDS` late; each leader records when it started its first broadcast inside its
    machine and when its last piece's all-reduce between the machines ended."""
    ts.MirroredStrategy()
    rank = dist.get_rank()
    ops = ts.HierarchicalCopyAllReduce()
    ops.create_groups([0, 0, 1, 1], timeout_seconds=60)
    buffer = torch.full((3 * PIECE_BYTES // 4,), float(rank + 1))
    events = {}
    all_reduce, broadcast = dist.all_reduce, dist.broadcast
    crosses = []

    def traced_all_reduce(tensor, *args, **kwargs):     # only the leaders' crosses call it
        crosses.append(tensor)
        last = len(crosses) == 3
        def start():
            work = all_reduce(tensor, *args, **kwargs)
            if last:
                work.get_future().then(
                    lambda _: events.setdefault("last crossed", time.perf_counter()))
            return work
        return _HeldWork(start) if last and rank == 2 else start()

    def traced_broadcast(*args, **kwargs):
        events.setdefault("first broadcast", time.perf_counter())
        return broadcast(*args, **kwargs)

    dist.all_reduce, dist.broadcast = traced_all_reduce, traced_broadcast
    try:
        start = time.perf_counter()
        ops.all_reduce(buffer, None)
    finally:
        dist.all_reduce, dist.broadcast = all_reduce, broadcast
    return from_every_replica({
        "sum": bool((buffer == 1 + 2 + 3 + 4).all()),
        "pieces crossed": len(crosses),
        **{name: at - start for name, at in events.items()}})


def test_a_piece_is_broadcast_inside_its_machine_while_later_pieces_still_cross():
    # The pipeline's promise: a piece's result goes back to the replicas of its machine as
    # soon as it has crossed between the machines, not once every piece has crossed. (A
    # leader once waited for every piece's cross before broadcasting any: one buffer took
    # 263-277 ms at 2 Gbit/s where the link alone takes 236.)
    replicas = launch(_broadcast_while_crossing, n=4)
    for rank, replica in enumerate(replicas):
        assert replica["sum"], rank
    for rank in (0, 2):                       # the machines' leaders
        replica = replicas[rank]
        assert replica["pieces crossed"] == 3, replica
        assert replica["last crossed"] >= HELD_SECONDS, replica     # it was held back
        assert replica["first broadcast"] < replica["last crossed"] - HELD_SECONDS / 2, \
            replica


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _cannot_create(directory):
    ts.MirroredStrategy()
    rank = dist.get_rank()
    lines = _Lines()
    logging.getLogger("torchstrategy").addHandler(lines)
    logging.getLogger("torchstrategy").setLevel(logging.INFO)
    group = dist.new_group([0, 1])
    memory = open_machine_memory(group, 0, rank, 2, PIECE_BYTES, timeout_seconds=30,
                                 directory=directory)
    every = [None] * 2
    dist.all_gather_object(every, (memory is None, lines.lines))
    return every


def test_a_machine_that_cannot_make_the_segment_keeps_tcp_on_every_replica(tmp_path):
    directory = str(tmp_path / "no-such-dir")
    (leader_none, leader_lines), (other_none, other_lines) = launch(_cannot_create,
                                                                     directory, n=2)
    assert leader_none and other_none
    # The leader, who could not create it, says why, naming the directory.
    assert any("keeps the local group's TCP inside the machine" in line and directory in line
               for line in leader_lines), leader_lines


def test_a_replica_waiting_on_a_stopped_one_ends_at_the_timeout_with_the_reason(tmp_path):
    slots, slot_bytes = 2, 4096
    path = tmp_path / "segment"
    path.write_bytes(bytes(segment_size(2, slots, slot_bytes)))
    storage = torch.from_file(str(path), shared=True, size=path.stat().st_size,
                              dtype=torch.uint8)
    replica = MachineMemory(storage, 1, 2, slot_bytes, slots, timeout_seconds=0.2)
    leader = MachineMemory(storage, 0, 2, slot_bytes, slots, timeout_seconds=0.2)
    piece = torch.arange(4.0)
    replica.wait_consumed(1)          # the first `slots` pieces never wait
    replica.contribution(1, 0, piece).copy_(piece)
    assert torch.equal(leader.contribution(1, 0, piece), piece)   # the same bytes
    with pytest.raises(RuntimeError, match=r"waited 0.2 s \(the collective timeout\) for "
                       r"the machine's leader to add the piece before it"):
        replica.wait_consumed(2)      # slot 0 again: piece 0 not yet added by the leader
    leader.mark_consumed(0)
    replica.wait_consumed(2)          # now free
    with pytest.raises(RuntimeError, match="local replica 1 to copy out the result"):
        leader.wait_copied_out(2)
    replica.mark_copied_out(0)
    leader.wait_copied_out(2)
    with pytest.raises(ValueError, match="does not fit a slot"):
        replica.contribution(1, 0, torch.zeros(slot_bytes // 4 + 1))


def test_shared_memory_must_be_a_bool():
    with pytest.raises(TypeError, match="shared_memory must be True or False"):
        ts.HierarchicalCopyAllReduce(shared_memory="yes")
    assert repr(ts.HierarchicalCopyAllReduce(2, shared_memory=False)) == \
        "HierarchicalCopyAllReduce(num_packs=2, shared_memory=False)"
