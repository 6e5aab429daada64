"""HierarchicalCopyAllReduce inside a machine through shared memory (machine_memory.py).

4 real gloo replicas laid out as 2 "machines" of 2 (they share this machine's /dev/shm, as
the replicas of one machine do): the sums through shared memory equal a plain all-reduce
bit for bit (integer-valued data, so that no summation order can change a bit), with
buffers of several dtypes handed over together before any is waited for (and waited for in
order, then last first, as the gradient reducer does), one of them
with more pieces than the segment has slots (so slots are reused within one buffer and
across buffers); the same with shared_memory=False (the local group's TCP); no file is
left in /dev/shm. Where the segment cannot be made, every replica of the machine keeps the
TCP path; a replica waiting on a stopped one ends at the timeout with the reason.
"""
import glob
import logging

import pytest
import torch
import torch.distributed as dist

import torchstrategy as ts
from tests.helpers.replicas import launch
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
