"""Fused collectives over a strategy's process group.

Every operation takes a *list* of tensors and moves them in as few collectives as possible:
tensors are grouped by dtype, packed into one flat buffer per dtype with the fused
``torchstrategy._C`` kernels, reduced, and unpacked (with the 1/N of MEAN fused into the
unpack). Many small tensors therefore cost one collective, not one each. `broadcast_`
sends a large tensor (`DIRECT_BROADCAST_BYTES`) by itself, in place: no reduction to fuse,
and the pack and unpack would cost more than the collective saved.

With one replica every operation is local and issues no collective.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import itertools
import math
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from torchstrategy import _ops, runtime
from torchstrategy.collectives import roll_call
from torchstrategy.collectives.cross_device_ops import CrossDeviceOps, Pending, wait_for
from torchstrategy.communication_options import (CommunicationImplementation,
                                                 CommunicationOptions)
from torchstrategy.reduce_op import ReduceOp, as_reduce_op, check_mean_dtype


# `Communicator.broadcast_` sends a tensor of at least this many bytes by a broadcast of
# its own, in place, and packs the smaller ones into one flat buffer per dtype. A broadcast
# of 16 KiB costs 0.3-0.4 ms on gloo over loopback; packing adds a new buffer on each side,
# a pack and an unpack copy. Measured (2 processes, 2 cores, load 1.4-1.9; 64 MiB
# of float32 into touched tensors; packed / one broadcast per tensor, 3 runs): tensors of
# 256 KiB 85-100 / 120-142 ms, of 1 MiB 46-88 / 41-61 ms, of 4 MiB 83-119 / 37-58 ms.
DIRECT_BROADCAST_BYTES = 1 << 20

# What replicas compare before a collective: (shape, dtype name) of each tensor.
Layout = Sequence[tuple[tuple[Any, ...], str]]
# Says, for a failed collective, which replicas are to blame: ``diagnose(rank) -> sentence``.
Diagnose = Callable[[int], str]


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another replica died, hangs, or issued different
    collectives. Raised instead of waiting forever."""


@contextlib.contextmanager
def explained_failures(what: str, rank: int, diagnose: Diagnose | None = None
                       ) -> Iterator[None]:
    """Re-raises a backend failure inside the block as a `CollectiveError` that says what
    was being done and what usually causes it (the backend's text is kept). `diagnose`,
    if given, is called with `rank` and returns one more sentence (e.g. naming the replicas
    that stopped answering)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        text = str(error)
        if "Timed out" in text or "timeout" in text.lower():
            cause = ("did not complete within the strategy's timeout: another replica is "
                     "stuck or slow, or did not call the same collective (every replica "
                     "must run the same collectives in the same order)")
        elif "closed" in text.lower() or "reset" in text.lower() or "broken" in text.lower():
            cause = ("failed because another replica died or ended (its connection "
                     "closed)")
        else:
            raise
        diagnosis = ""
        if diagnose is not None:
            diagnosis = diagnose(rank) + " "
        raise CollectiveError(f"torchstrategy: {what} on replica {rank} {cause}. {diagnosis}"
                              f"Backend: {text.splitlines()[0][:300]}") from error


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[int], int]:
    offsets: list[int] = []
    numels: list[int] = []
    total = 0
    for t in tensors:
        offsets.append(total)
        numels.append(t.numel())
        total += t.numel()
    return offsets, numels, total


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def _shape_outside(tensor: torch.Tensor, axis: int) -> tuple[Any, ...]:
    """`tensor`'s shape with the size along `axis` replaced by "*" (it may differ)."""
    axis %= tensor.dim()
    return tuple("*" if d == axis else size for d, size in enumerate(tensor.shape))


def _by_dtype(tensors: Sequence[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = collections.OrderedDict()
    for index, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(index)
    return groups


def _packs(tensors: Sequence[torch.Tensor], bytes_per_pack: int) -> list[list[int]]:
    """Indices of `tensors` in packs of one dtype each and, when `bytes_per_pack` > 0, at
    most that many bytes (a larger tensor travels alone)."""
    packs: list[list[int]] = []
    for indices in _by_dtype(tensors).values():
        if not bytes_per_pack:
            packs.append(indices)
            continue
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = tensors[i].numel() * tensors[i].element_size()
            if current and size + nbytes > bytes_per_pack:
                packs.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        packs.append(current)
    return packs


def _fingerprint(layout: Layout) -> int:
    """A 63-bit number equal on every replica whose `layout` (a picklable description of
    the values about to travel) is equal; Python's own hash differs between processes."""
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _describe_leaf(leaf: tuple[tuple[Any, ...], str]) -> str:
    shape, dtype = leaf
    return f"{dtype} {list(shape)}"


def describe_layout_difference(what: str, layouts: Sequence[Layout], note: str = "") -> str:
    """The error message for replicas whose `layouts` (``layouts[r]``: replica r's list of
    (shape, dtype) per tensor) differ: the first differing tensor, its shape and dtype on
    replica 0 and on the first replica that differs, and every replica that differs;
    `note` (a sentence) is appended."""
    reference = layouts[0]
    differing = [r for r, layout in enumerate(layouts) if layout != reference]
    other = differing[0]
    theirs = layouts[other]
    others = ", ".join(str(r) for r in differing)
    fix = (f"Every replica must give {what} values of the same structure, shapes and "
           "dtypes (cast, or pad the uneven last batch; strategy.gather / all_gather accept "
           f"different sizes along their axis).{note}")
    if len(theirs) != len(reference):
        return (f"torchstrategy: replicas gave {what} different numbers of tensors: "
                f"{len(reference)} on replica 0, {len(theirs)} on replica {other} (differing: "
                f"replica(s) {others}). {fix}")
    index = next(i for i, (a, b) in enumerate(zip(reference, theirs)) if a != b)
    kinds = []
    if reference[index][0] != theirs[index][0]:
        kinds.append("shapes")
    if reference[index][1] != theirs[index][1]:
        kinds.append("dtypes")
    return (f"torchstrategy: replicas gave {what} values of different {' and '.join(kinds)}: "
            f"tensor {index} is {_describe_leaf(reference[index])} on replica 0 but "
            f"{_describe_leaf(theirs[index])} on replica {other} (differing: replica(s) "
            f"{others}). {fix}")


def _roll_call(world_size: int) -> Diagnose:
    """The default diagnosis of a failed collective: a roll call (see `roll_call`) whose
    token counts the multi-replica communicators of this process, which every replica
    creates in the same order, so no collective is needed to agree on it."""
    groups = runtime.current().state("torchstrategy.collectives.roll-call-groups",
                                     itertools.count)
    return roll_call.RollCall(f"group-{next(groups)}", world_size,
                              lambda rank: f"replica {rank}").describe_missing


class Communicator:
    """Collectives among the replicas of one strategy.

    Args:
      group: the process group (None: torch.distributed's default group).
      rank / world_size: this replica's id and the number of replicas.
      device: the device buffers are reduced on (the replica's device).
      cross_device_ops: the all-reduce algorithm (a `CrossDeviceOps`).
      diagnose: optional ``diagnose(rank) -> str``, one sentence added to every
        `CollectiveError`. Default with several replicas: a roll call naming the replicas
        that stopped answering or ended their program (`roll_call.RollCall`); the
        multi-worker strategy gives one that also names their machines.
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int,
                 device: torch.device, cross_device_ops: CrossDeviceOps,
                 diagnose: Diagnose | None = None) -> None:
        # Buffers handed to a backend thread stay referenced until it lets go of them (see
        # `Runtime.hold`); bound once here, not looked up per collective.
        self.hold = runtime.current().hold
        if diagnose is None and world_size > 1:
            diagnose = _roll_call(world_size)
        self.diagnose = diagnose
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.cross_device_ops = cross_device_ops

    def _explained(self, what: str) -> contextlib.AbstractContextManager[None]:
        return explained_failures(what, self.rank, self.diagnose)

    @property
    def backend(self) -> str:
        """"nccl" for CUDA replicas, "gloo" otherwise (the process group's backend)."""
        return "nccl" if self.device is not None and self.device.type == "cuda" else "gloo"

    def resolve_options(self, options: CommunicationOptions | None
                        ) -> tuple[datetime.timedelta | None, int]:
        """(timeout as a timedelta or None, bytes per pack or 0) from a collective's
        `options` (a `ts.CommunicationOptions` or None), refusing what cannot be honoured.

        Honoured: ``timeout_seconds`` (this collective fails after it instead of the
        strategy's timeout), ``bytes_per_pack`` (tensors travel in packs of at most that many
        bytes), ``implementation`` AUTO or the one this strategy's group uses.

        Raises:
          TypeError: `options` is not a CommunicationOptions.
          ValueError: an implementation or compression this strategy's group does not use.
        """
        if options is None:
            return None, 0
        if not isinstance(options, CommunicationOptions):
            raise TypeError(f"options must be a ts.CommunicationOptions (or None), got "
                            f"{options!r}.")
        wanted = options.implementation
        used = CommunicationImplementation.NCCL if self.backend == "nccl" else \
            CommunicationImplementation.RING
        if wanted is not CommunicationImplementation.AUTO and wanted is not used:
            raise ValueError(
                f"CommunicationOptions(implementation={wanted.name}) cannot be honoured here: "
                f"this strategy's replicas communicate with {used.name} ({self.backend}), "
                "chosen when the strategy was created. Use AUTO (or "
                f"{used.name}) per call, or create the strategy with the implementation "
                "you want.")
        strategy_compression = getattr(self.cross_device_ops, "compression", None)
        if options.compression is not None and options.compression != strategy_compression:
            raise ValueError(
                f"CommunicationOptions(compression={options.compression!r}) applies to "
                "gradient buckets and is set when the strategy is created "
                "(ts.NcclAllReduce(compression=...) or the multi-worker strategy's "
                "communication_options); values reduced explicitly travel uncompressed.")
        timeout = None if options.timeout_seconds is None else \
            datetime.timedelta(seconds=float(options.timeout_seconds))
        return timeout, options.bytes_per_pack

    # -- all-reduce -------------------------------------------------------------------
    def all_reduce(self, tensors: Iterable[torch.Tensor], op: ReduceOp | str,
                   inplace: bool = False, options: CommunicationOptions | None = None,
                   check_layout: bool = True) -> list[torch.Tensor]:
        """Reduces each tensor across replicas; returns the results in the input order.

        With `inplace` the results are written into the given tensors (which are returned).
        Results have the input's dtype and device. `options`: see `resolve_options`.

        With `check_layout` (the default) the replicas first compare the number, shapes and
        dtypes of their tensors (one all-gather of one number; see `check_same_layout`), so
        that values that differ are an error naming them, not a crash of the backend or a
        silent reduction of reinterpreted values. Every replica must pass the same
        `check_layout`; callers whose layout is known to agree (the mirrored buffers,
        compared when the scope was left) pass False.

        Raises:
          ValueError: MEAN of integer or bool tensors (cast to a floating type first);
            replicas whose tensors differ in number, shape or dtype.
        """
        op = as_reduce_op(op)
        timeout, bytes_per_pack = self.resolve_options(options)
        tensors = list(tensors)
        if op is ReduceOp.MEAN:
            for t in tensors:
                check_mean_dtype(op, t)
        if self.world_size == 1:
            return tensors if inplace else [t.clone() for t in tensors]
        if check_layout:
            self.check_same_layout("reduce / all_reduce",
                                   [(tuple(t.shape), _dtype_name(t)) for t in tensors])
        scale = 1.0 / self.world_size if op is ReduceOp.MEAN else 1.0
        results: list[Any] = list(tensors) if inplace else [None] * len(tensors)
        pending: list[tuple[list[int], list[torch.Tensor], list[int], torch.Tensor,
                            Pending]] = []
        for indices in _packs(tensors, bytes_per_pack):
            members = [tensors[i] for i in indices]
            dtype = members[0].dtype
            offsets, numels, total = _layout(members)
            wire_dtype = torch.int32 if dtype == torch.bool else dtype
            flat = torch.empty(total, dtype=wire_dtype, device=self.device)
            _ops.pack(flat, members, offsets, numels)
            pending.append((indices, members, offsets, flat,
                            self.cross_device_ops.all_reduce_async(flat, self.group)))
        self.hold(*[p[3] for p in pending])
        for indices, members, offsets, flat, work in pending:
            with self._explained("all_reduce"):
                wait_for(work, timeout)
            if flat.dtype != members[0].dtype:  # bool travelled as int32: SUM means "any"
                flat = flat.ne(0)
            outputs = members if inplace else [torch.empty_like(t) for t in members]
            _ops.unpack(flat, outputs, offsets, scale)
            for i, out in zip(indices, outputs):
                results[i] = out
        return results

    # -- broadcast --------------------------------------------------------------------
    def broadcast_(self, tensors: Iterable[torch.Tensor], src: int = 0) -> list[torch.Tensor]:
        """Overwrites every tensor with replica `src`'s value, in place; returns them (in
        the input order). A collective: every replica passes tensors of the same number,
        shapes and dtypes, in the same order.

        A tensor of at least `DIRECT_BROADCAST_BYTES` travels alone: when it is contiguous
        and on this replica's device it is itself the buffer sent from and received into
        (no new buffer, no copy), else through a contiguous copy of it on the device. The
        smaller ones travel in one flat buffer per dtype (packed on `src`, unpacked on the
        others). How a tensor travels depends only on its size and dtype, never on its
        layout or device, so every replica issues the same collectives.
        """
        tensors = [t for t in tensors]
        if self.world_size == 1 or not tensors:
            return tensors
        with torch.no_grad():
            for dtype, indices in _by_dtype(tensors).items():
                small: list[torch.Tensor] = []
                for i in indices:
                    tensor = tensors[i].detach()
                    if tensor.numel() * tensor.element_size() >= DIRECT_BROADCAST_BYTES:
                        self._broadcast_alone(tensor, src)
                    else:
                        small.append(tensor)
                if not small:
                    continue
                offsets, numels, total = _layout(small)
                flat = torch.empty(total, dtype=dtype, device=self.device)
                if self.rank == src:
                    _ops.pack(flat, small, offsets, numels)
                self.hold(flat)
                with self._explained("broadcast"):
                    dist.broadcast(flat, src=src, group=self.group)
                if self.rank != src:
                    _ops.unpack(flat, small, offsets)
        return tensors

    def _broadcast_alone(self, tensor: torch.Tensor, src: int) -> None:
        """Overwrites `tensor` (detached) with replica `src`'s value by one broadcast of its
        own: in place when it is contiguous and on this replica's device (the backend
        needs a dense buffer on its device), else through a contiguous copy there."""
        direct = tensor.is_contiguous() and tensor.device == self.device
        if direct:
            buffer = tensor
        else:
            # Not `tensor.to(device, memory_format=...)`: on the same device it returns a
            # transposed tensor itself (its suggested format is already "contiguous").
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
            if self.rank == src:
                buffer.copy_(tensor)
        # Held like the flat buffers: the backend's thread may let go of `buffer` after
        # the broadcast returned (see `Runtime.hold`); `buffer` is a detached alias whose
        # only other owner is this call, so it is released at a later hold.
        self.hold(buffer)
        with self._explained("broadcast"):
            dist.broadcast(buffer, src=src, group=self.group)
        if not direct and self.rank != src:
            tensor.copy_(buffer)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Returns replica `src`'s `obj` on every replica (small picklable objects)."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        with self._explained("broadcast"):
            dist.broadcast_object_list(box, src=src, group=self.group,
                                       device=self.device if self.device.type == "cuda"
                                       else None)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every replica's `obj` (small, picklable), as a list in replica order."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        with self._explained("all_gather"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def check_same_layout(self, what: str, layout: Layout, note: str = "") -> None:
        """Raises unless every replica passes an equal `layout` (a list of (shape, dtype) per
        tensor). A collective: every replica calls it at the same point.

        Costs one all-gather of one number per replica; the full layouts travel only when
        they differ, to name the difference.

        Raises:
          ValueError: naming the first differing tensor, its shape and dtype on replica 0
            and on a replica that differs, and every replica that differs.
        """
        mine = torch.tensor([_fingerprint(layout)], dtype=torch.int64)
        fingerprints = self._gather_rows(mine, 1, what)[:, 0].tolist()
        if len(set(fingerprints)) == 1:
            return
        layouts = self.gather_objects(layout)
        raise ValueError(describe_layout_difference(what, layouts, note))

    # -- all-gather -------------------------------------------------------------------
    def all_gather(self, tensors: Iterable[torch.Tensor], axis: int,
                   options: CommunicationOptions | None = None) -> list[torch.Tensor]:
        """Concatenates each tensor from every replica along `axis`, in replica order.

        Sizes along `axis` may differ between replicas; every other dimension must agree.
        `options`: see `resolve_options` (``bytes_per_pack`` does not apply: each dtype is
        gathered in one collective).

        Raises:
          ValueError: a scalar tensor, an axis out of range, or shapes that disagree
            between replicas outside `axis`.
        """
        timeout, _ = self.resolve_options(options)
        tensors = list(tensors)
        moved = []
        for index, t in enumerate(tensors):
            if t.dim() == 0:
                raise ValueError(f"Cannot gather a scalar (leaf {index}) along axis {axis}; "
                                 "give it a dimension first, e.g. t.reshape(1).")
            if not -t.dim() <= axis < t.dim():
                raise ValueError(f"axis {axis} is out of range for leaf {index} of shape "
                                 f"{tuple(t.shape)}.")
            moved.append(t.movedim(axis, 0).contiguous())
        if self.world_size == 1:
            return [t.clone() for t in tensors]
        # Two small collectives: first the number, dtypes and shapes outside `axis` of the
        # leaves (so that a mismatch is an error, not a collective of mismatched sizes or
        # dtypes), then every leaf's size along `axis`.
        self.check_same_layout(
            "gather / all_gather",
            [(_shape_outside(t, axis), _dtype_name(t)) for t in tensors],
            note=f" (* marks axis {axis}, whose size may differ.)")
        mine: list[int] = []
        for t in moved:
            mine += [t.shape[0], math.prod(t.shape[1:])]
        sizes = self._gather_rows(torch.tensor(mine, dtype=torch.int64), 2 * len(moved))
        rows = sizes[:, 0::2]   # [replica, leaf] sizes along axis
        inner = sizes[:, 1::2]  # [replica, leaf] elements per row
        results: list[Any] = [None] * len(moved)
        for dtype, indices in _by_dtype(moved).items():
            members = [moved[i] for i in indices]
            lengths = [sum(int(rows[r, i]) * int(inner[r, i]) for i in indices)
                       for r in range(self.world_size)]
            longest = max(lengths)
            offsets, numels, _ = _layout(members)
            flat = torch.zeros(longest, dtype=dtype, device=self.device)
            _ops.pack(flat, members, offsets, numels)
            gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
            self.hold(flat, *gathered)
            with self._explained("all_gather"):
                wait_for(dist.all_gather(gathered, flat, group=self.group, async_op=True),
                         timeout)
            for k, i in enumerate(indices):
                parts = []
                for r in range(self.world_size):
                    start = sum(int(rows[r, j]) * int(inner[r, j]) for j in indices[:k])
                    count = int(rows[r, i]) * int(inner[r, i])
                    shape = (int(rows[r, i]),) + tuple(moved[i].shape[1:])
                    parts.append(gathered[r][start:start + count].view(shape))
                results[i] = torch.cat(parts).movedim(0, axis).to(tensors[i].device)
        return results

    def _gather_rows(self, row: torch.Tensor, width: int, what: str = "all_gather"
                     ) -> torch.Tensor:
        row = row.to(self.device)
        out = [torch.empty(width, dtype=row.dtype, device=self.device)
               for _ in range(self.world_size)]
        self.hold(row, *out)
        with self._explained(what):
            dist.all_gather(out, row, group=self.group)
        return torch.stack(out).cpu()

    def barrier(self) -> None:
        """Waits until every replica has reached this point (bounded by the timeout)."""
        if self.world_size > 1:
            with self._explained("barrier"):
                if self.device.type == "cuda":
                    dist.barrier(group=self.group, device_ids=[self.device.index])
                else:
                    dist.barrier(group=self.group)
