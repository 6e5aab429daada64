"""`HierarchicalCopyAllReduce`: reduce inside each machine, all-reduce across machines, broadcast.

On a cluster the links inside a machine (NVLink, shared memory) are much faster than the
network between machines. Reducing locally first sends one buffer per machine over the
network instead of one per replica:

1. inside each machine, every replica's buffer is summed onto the machine's first replica
   (its *leader*);
2. the leaders all-reduce the machine sums among themselves;
3. each leader broadcasts the total back to the replicas of its machine.

The subgroups (one per machine, plus one of the leaders) are created once, collectively on
every replica, when the multi-worker strategy is created (`create_groups`). Until then, and
whenever the layout has a single machine (or one replica per machine), the op is a plain
all-reduce over the group it is given.
"""
from __future__ import annotations

import datetime
from typing import Callable, Hashable, Sequence

import torch
import torch.distributed as dist

from torchstrategy import runtime
from torchstrategy.collectives.cross_device_ops import (CrossDeviceOps, Pending, _All, _Done,
                                                        wait_for)


class _Stages:
    """A handle that runs dependent collectives one after another when waited on: each
    stage starts only once the previous one has landed."""

    def __init__(self, first: Pending, later: Sequence[Callable[[], Pending]]) -> None:
        self._first = first
        self._later = later

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        wait_for(self._first, timeout)
        for stage in self._later:
            wait_for(stage(), timeout)
        return True


class _Layout:
    """This replica's view of the machine layout: its machine's group and leader, and the
    leaders' group (only on leaders)."""

    def __init__(self, local_group: dist.ProcessGroup | None, leader: int | None,
                 cross_group: dist.ProcessGroup | None, is_leader: bool,
                 num_machines: int) -> None:
        self.local_group = local_group
        self.leader = leader
        self.cross_group = cross_group
        self.is_leader = is_leader
        self.num_machines = num_machines


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Sums inside each machine, then across machines (one replica per machine), then
    broadcasts the result back inside each machine (TensorFlow's name and argument).

    Args:
      num_packs: the buffer is split into this many chunks, each reduced on its own, so that
        a large buffer's chunks can be in flight together.

    The result equals a plain all-reduce up to floating-point summation order.
    """

    def __init__(self, num_packs: int = 1) -> None:
        if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 1:
            raise ValueError(f"num_packs must be a positive int, got {num_packs!r}.")
        self.num_packs = num_packs
        self._layout: _Layout | None = None

    @property
    def num_machines(self) -> int:
        """Machines in the layout the groups were created for (1 before `create_groups`)."""
        return 1 if self._layout is None else self._layout.num_machines

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
        self._layout = _Layout(local_group, leader, cross_group if is_leader else None,
                               is_leader, len(machines))
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
        first = dist.reduce(chunk, dst=layout.leader, group=layout.local_group, async_op=True)
        later: list[Callable[[], Pending]] = []
        if layout.is_leader:
            later.append(lambda: dist.all_reduce(chunk, group=layout.cross_group,
                                                 async_op=True))
        later.append(lambda: dist.broadcast(chunk, src=layout.leader,
                                            group=layout.local_group, async_op=True))
        return _Stages(first, later)

    def __repr__(self) -> str:
        return f"HierarchicalCopyAllReduce(num_packs={self.num_packs})"
