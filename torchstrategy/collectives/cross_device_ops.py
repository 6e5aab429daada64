"""Cross-device ops: the algorithm used to all-reduce a flat buffer, as tf.distribute names them.

A `CrossDeviceOps` reduces one flat, contiguous buffer in place over the process group and
returns a handle whose ``wait()`` finishes the reduction. The gradient reducer and the
fused collectives hand every buffer to the strategy's cross-device ops.
"""
import torch
import torch.distributed as dist

from torchstrategy.collectives.compression import check_compression


def wait_for(work, timeout=None):
    """``work.wait()``, bounded by `timeout` (a timedelta) when one is given; otherwise by
    the process group's own timeout."""
    return work.wait() if timeout is None else work.wait(timeout)


class _Done:
    """A finished handle (world size 1)."""

    def wait(self, timeout=None):
        return True


class _Chain:
    """Runs dependent collectives one after another when waited on."""

    def __init__(self, first, then):
        self._first = first
        self._then = then

    def wait(self, timeout=None):
        wait_for(self._first, timeout)
        wait_for(self._then(), timeout)
        return True


class _All:
    def __init__(self, works):
        self._works = works

    def wait(self, timeout=None):
        for work in self._works:
            wait_for(work, timeout)
        return True


class CrossDeviceOps:
    """Base class. Subclasses implement `all_reduce_async` (a SUM, in place).

    ``compression`` (None here) is the wire dtype the gradient reducer casts buckets to
    before handing them to `all_reduce_async` ("bf16", "fp16" or None).
    """

    compression = None

    def all_reduce_async(self, flat, group):
        raise NotImplementedError("abstract: subclasses implement all_reduce_async")

    def all_reduce(self, flat, group):
        """Sums `flat` over the group in place and returns it."""
        self.all_reduce_async(flat, group).wait()
        return flat

    def __repr__(self):
        return f"{type(self).__name__}()"


class NcclAllReduce(CrossDeviceOps):
    """All-reduce over the process group: NCCL on GPU, gloo's ring on CPU (the default).

    Args:
      num_packs: the buffer is split into this many chunks, each its own collective, so
        that a large buffer's chunks can be in flight together.
      compression: None, "bf16" or "fp16": gradient buckets of wider floating dtypes travel
        in that dtype (half the bytes; each sum rounded to it, see
        `torchstrategy.collectives.compression`). Values reduced with
        ``strategy.reduce`` are never compressed.
    """

    def __init__(self, num_packs=1, compression=None):
        if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 1:
            raise ValueError(f"num_packs must be a positive int, got {num_packs!r}.")
        self.num_packs = num_packs
        self.compression = check_compression(compression)

    def all_reduce_async(self, flat, group):
        if dist.get_world_size(group) == 1:
            return _Done()
        if self.num_packs == 1 or flat.numel() < self.num_packs:
            return dist.all_reduce(flat, group=group, async_op=True)
        return _All([dist.all_reduce(chunk, group=group, async_op=True)
                     for chunk in torch.tensor_split(flat, self.num_packs)])

    def __repr__(self):
        if self.compression is None:
            return f"NcclAllReduce(num_packs={self.num_packs})"
        return f"NcclAllReduce(num_packs={self.num_packs}, compression={self.compression!r})"


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce onto replica `reduce_to_replica` (0), then broadcast from it.

    Args:
      reduce_to_device: must be None. In TensorFlow it names the device one process reduces
        on; here every replica is its own process, so the reduction happens on replica
        `reduce_to_replica`'s device: pick it with that argument.
      reduce_to_replica: the replica that receives the sum and broadcasts it.

    Raises:
      ValueError: a `reduce_to_device`, or a negative `reduce_to_replica`.
    """

    def __init__(self, reduce_to_device=None, reduce_to_replica=0):
        if reduce_to_device is not None:
            raise ValueError(
                f"ReductionToOneDevice(reduce_to_device={reduce_to_device!r}) is not "
                "supported: each replica is its own process, so the sum is formed on one "
                "replica's device. Use ReductionToOneDevice(reduce_to_replica=N) instead.")
        if isinstance(reduce_to_replica, bool) or not isinstance(reduce_to_replica, int) \
                or reduce_to_replica < 0:
            raise ValueError(f"reduce_to_replica must be a replica id (int >= 0), got "
                             f"{reduce_to_replica!r}.")
        self.reduce_to_device = None
        self.reduce_to_replica = reduce_to_replica

    def all_reduce_async(self, flat, group):
        if dist.get_world_size(group) == 1:
            return _Done()
        root = dist.get_global_rank(group, self.reduce_to_replica) if group is not None and \
            group != dist.group.WORLD else self.reduce_to_replica
        first = dist.reduce(flat, dst=root, group=group, async_op=True)
        # The broadcast may only start once the reduction has landed on the root.
        return _Chain(first, lambda: dist.broadcast(flat, src=root, group=group,
                                                    async_op=True))


def as_cross_device_ops(value):
    """Returns `value` checked, or the default `NcclAllReduce()` for None.

    Raises:
      TypeError: for anything that is not a `CrossDeviceOps`.
    """
    if value is None:
        return NcclAllReduce()
    if not isinstance(value, CrossDeviceOps):
        raise TypeError(f"cross_device_ops must be a ts.CrossDeviceOps such as "
                        f"ts.NcclAllReduce() or ts.ReductionToOneDevice(), got {value!r}.")
    return value
