"""The bucketed gradient reducer: after ``backward()`` every mirrored gradient is the sum
over replicas.

How it works (the design DDP's reducer made standard):

- Parameters are laid out in *buckets*, one dtype and device per bucket, each at most
  ``bucket_cap_bytes`` (25 MiB); the first bucket is small so communication starts early.
  The first layout follows reverse registration order; after the first synchronised
  backward the buckets are rebuilt once in the order gradients actually arrived (replica
  0's order, broadcast, so every replica has the same buckets). Every parameter's slot
  starts on a 16-byte boundary.
- Gradients live *inside* their bucket: after a step each ``.grad`` is a view into the
  bucket's flat buffer, so autograd accumulates the next step's gradient straight into the
  bucket and the all-reduce needs no copy (DDP's ``gradient_as_bucket_view``). A gradient
  that is not a view (the first step, ``zero_grad(set_to_none=True)``, a ``.grad`` the user
  assigned) is copied into its slot by one fused C++ call per bucket and then replaced by
  the view.
- A post-accumulate-grad hook on each parameter marks it ready. When every parameter of a
  bucket is ready, its all-reduce is launched asynchronously while backward goes on.
  Buckets are launched strictly in bucket order, so every replica issues the same
  collectives in the same order whatever order its gradients arrive in.
- A callback queued on the autograd engine runs when backward finishes: it launches the
  buckets still waiting (parameters that got no gradient this step contribute zeros),
  waits for every all-reduce, and settles ``.grad`` before ``backward()`` returns.
- With compression (``ts.NcclAllReduce(compression="bf16")``) a bucket is cast into a
  half-size wire buffer by a fused kernel, all-reduced, and cast back.

Each bucket carries one extra element per parameter: 1 if this replica contributed a
gradient for it. After the all-reduce that count tells whether *any* replica did; a
parameter no replica used keeps its ``.grad`` untouched (None stays None), exactly as
without a strategy, and a parameter used on only some replicas gets the sum of theirs.
When every parameter of a bucket got its gradient (the usual case) nothing is traversed.

Gradient accumulation. What a ``.grad`` holds before a synchronised backward was already
summed by the previous one (or zeroed), so it is kept as it is and only this backward's
new gradients are summed: two synchronised ``backward()`` calls without ``zero_grad()``
give ``g1_sum + g2_sum``, never N times the first. Under ``no_sync()`` gradients accumulate
locally; the next synchronised backward sums everything accumulated since.

Because gradients are views, a ``.grad`` tensor kept from one step is overwritten by the
next step's gradients (as with DDP's ``gradient_as_bucket_view``): clone it to keep it.
"""
import contextlib
import time

import torch

from torchstrategy import _ops
from torchstrategy.collectives.communicator import explained_failures, hold
from torchstrategy.collectives.compression import wire_dtype
from torchstrategy.collectives.stats import ReductionStats

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
ALIGNMENT_BYTES = 16


def aligned(elements, element_size):
    """`elements` rounded up so that the next slot starts on a 16-byte boundary."""
    step = max(1, ALIGNMENT_BYTES // element_size)
    return -(-elements // step) * step


class _Bucket:
    __slots__ = ("params", "offsets", "numels", "size", "dtype", "device", "flat", "views",
                 "ready", "pending", "complete", "work", "wire", "index")

    def __init__(self, index, dtype, device):
        self.index = index
        self.params = []
        self.offsets = []
        self.numels = []
        self.size = 0          # elements up to the end of the last slot
        self.dtype = dtype
        self.device = device
        self.flat = None
        self.views = []
        self.ready = []
        self.pending = 0
        self.complete = False  # every parameter contributed (launched with pending == 0)
        self.work = None
        self.wire = None

    def add(self, param):
        offset = aligned(self.size, param.element_size())
        self.params.append(param)
        self.offsets.append(offset)
        self.numels.append(param.numel())
        self.size = offset + param.numel()

    @property
    def flags_at(self):
        return aligned(self.size, self.flat.element_size())

    def allocate(self):
        # Padding stays zero forever; the trailing len(params) elements carry the
        # "contributed" flags.
        flags_at = aligned(self.size, torch.empty((), dtype=self.dtype).element_size())
        self.flat = torch.zeros(flags_at + len(self.params), dtype=self.dtype,
                                device=self.device)
        self.views = [self.flat.narrow(0, o, n).view(p.shape)
                      for p, o, n in zip(self.params, self.offsets, self.numels)]
        self.reset()

    def reset(self):
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.complete = False
        self.work = None

    def is_view(self, position, grad):
        """True when `grad` is this parameter's slot of the bucket (not a copy of it)."""
        view = self.views[position]
        return (grad.data_ptr() == view.data_ptr() and grad.shape == view.shape
                and grad.dtype == view.dtype and grad.device == view.device
                and grad.stride() == view.stride())


class GradientReducer:
    """Sums the gradients of the registered parameters across replicas during backward.

    Args:
      communicator: the strategy's `Communicator` (its cross-device ops do the all-reduce,
        and their ``compression`` picks the wire dtype).
      bucket_cap_bytes: the largest bucket (25 MiB by default).
      first_bucket_bytes: the cap of the first bucket (1 MiB), so that the first all-reduce
        starts as soon as the last layers' gradients exist.
    """

    def __init__(self, communicator, bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES,
                 first_bucket_bytes=DEFAULT_FIRST_BUCKET_BYTES):
        if bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}.")
        self._comm = communicator
        self._cap = int(bucket_cap_bytes)
        self._first_cap = min(int(first_bucket_bytes), self._cap)
        self._params = []          # registration order
        self._known = set()        # ids of registered parameters
        self._slot = {}            # id(param) -> (bucket, position)
        self._buckets = []
        self._hooks = []
        self._sync = True
        # ids of the parameters that accumulated local gradients under no_sync since the
        # last synchronised backward (per parameter: a .grad of another parameter was
        # already summed and must not be summed again).
        self._local_ids = set()
        self._queued = False
        self._next_launch = 0
        self._stash = {}           # id(param) -> (param, .grad kept from before backward)
        self._synced_part = {}     # id(param) -> (param, summed .grad under a no_sync sum)
        self._any_ready = False
        self._arrival = None       # params in the order their gradients arrived (1st step)
        self._stats = ReductionStats()
        self._steps = 0
        self._stats_launched = 0   # collectives launched in the current backward
        self._stats_bytes = 0      # and their bytes

    # -- set-up -------------------------------------------------------------------------
    def add_parameters(self, params):
        """Registers parameters (those requiring grad; duplicates ignored) and re-buckets.

        The next synchronised backward records the order gradients arrive in, and the
        buckets are rebuilt once in that order after it."""
        added = False
        for p in params:
            if id(p) in self._known or not p.requires_grad:
                continue
            self._known.add(id(p))
            self._params.append(p)
            self._hooks.append(p.register_hook(self._make_pre_hook(p)))
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
            added = True
        if added:
            self._build_buckets(list(reversed(self._params)))
            self._arrival = []

    def _build_buckets(self, order):
        """Lays out `order` into buckets; gradients that were views move to the new ones."""
        moving = []
        for p in order:
            if p.grad is not None and id(p) in self._slot:
                bucket, position = self._slot[id(p)]
                if bucket.is_view(position, p.grad):
                    moving.append(p)
        buckets, open_buckets = [], {}
        for p in order:
            key = (p.dtype, p.device)
            bucket = open_buckets.get(key)
            if bucket is not None:
                cap = self._first_cap if bucket.index == 0 else self._cap
                end = aligned(bucket.size, p.element_size()) + p.numel()
                if end * p.element_size() > cap:
                    bucket = None
            if bucket is None:
                bucket = _Bucket(len(buckets), p.dtype, p.device)
                buckets.append(bucket)
                open_buckets[key] = bucket
            bucket.add(p)
        slot = {}
        for bucket in buckets:
            bucket.allocate()
            for position, p in enumerate(bucket.params):
                slot[id(p)] = (bucket, position)
        with torch.no_grad():
            for p in moving:
                bucket, position = slot[id(p)]
                bucket.views[position].copy_(p.grad)
                p.grad = bucket.views[position]
        self._slot = slot
        self._buckets = buckets
        self._next_launch = 0

    def _rebuild_from_arrival(self):
        """Rebuilds the buckets in the order gradients arrived in the first synchronised
        backward on replica 0 (broadcast: every replica must have the same buckets);
        parameters that got no gradient follow in reverse registration order."""
        index = {id(p): i for i, p in enumerate(self._params)}
        order, seen = [], set()
        for p in self._arrival:
            if id(p) not in seen:
                seen.add(id(p))
                order.append(index[id(p)])
        order += [i for i in reversed(range(len(self._params)))
                  if id(self._params[i]) not in seen]
        self._arrival = None
        (order,) = self._comm.broadcast_([torch.tensor(order, dtype=torch.int64)], src=0)
        self._build_buckets([self._params[i] for i in order.tolist()])

    @property
    def bucket_sizes(self):
        """Number of parameters in each bucket, in launch order."""
        return [len(b.params) for b in self._buckets]

    @property
    def bucket_order(self):
        """The registered parameters in bucket (launch) order."""
        return [p for b in self._buckets for p in b.params]

    def is_bucket_view(self, param):
        """True when ``param.grad`` lives in its bucket (no copy at the next all-reduce)."""
        if param.grad is None or id(param) not in self._slot:
            return False
        bucket, position = self._slot[id(param)]
        return bucket.is_view(position, param.grad)

    def stats(self):
        """The `ReductionStats` of the last synchronised backward."""
        return self._stats

    # -- no_sync ------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, without communication."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    # -- hooks --------------------------------------------------------------------------
    def _is_zero_view(self, param, grad):
        """A bucket view holding zeros (``zero_grad(set_to_none=False)``): autograd may
        accumulate into it in place. Checked on CPU only (on a GPU the check would
        synchronise the stream)."""
        if grad.device.type != "cpu":
            return False
        bucket, position = self._slot[id(param)]
        return bucket.is_view(position, grad) and not grad.any()

    def _make_pre_hook(self, param):
        def keep_previous_grad(grad):
            # Runs before autograd adds this backward's gradient to param.grad. A gradient
            # already there was summed by the previous synchronised backward: set it aside
            # so that only the new gradient is summed, and add it back afterwards.
            current = param.grad
            if current is None or id(param) in self._local_ids:
                return None
            if self._is_zero_view(param, current):
                return None   # nothing to keep: accumulate into the bucket directly
            bucket, position = self._slot[id(param)]
            if self._sync:
                # A view's memory is about to hold the new gradient: keep a copy.
                kept = current.clone() if bucket.is_view(position, current) else current
                self._stash[id(param)] = (param, kept)
                param.grad = None
                self._queue_finalize()
            else:
                # A no_sync backward is about to accumulate onto an already-summed
                # gradient: remember that part, so the next synchronised backward sums
                # only what was accumulated locally and adds this back once.
                self._synced_part[id(param)] = (param, current.detach().clone())
            return None
        return keep_previous_grad

    def _queue_finalize(self):
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _on_grad_ready(self, param):
        if not self._sync:
            self._local_ids.add(id(param))
            return
        self._queue_finalize()
        self._any_ready = True
        if self._arrival is not None:
            self._arrival.append(param)
        bucket, position = self._slot[id(param)]
        if bucket.ready[position]:
            raise RuntimeError(
                "A parameter received its gradient twice in one backward pass (reentrant "
                "activation checkpointing?). Use torch.utils.checkpoint with "
                "use_reentrant=False under a torchstrategy strategy.")
        bucket.ready[position] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_in_order()

    # -- communication ------------------------------------------------------------------
    def _launch_in_order(self):
        while self._next_launch < len(self._buckets) and \
                self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _contribution(self, bucket, position):
        """This replica's gradient for a parameter of a bucket launched incomplete, or None.
        A view that holds an older sum is set aside first: its slot is about to be zeroed."""
        param = bucket.params[position]
        if bucket.ready[position]:
            return param.grad
        if id(param) in self._local_ids and param.grad is not None:
            return param.grad  # accumulated under no_sync, not yet summed
        if param.grad is not None and bucket.is_view(position, param.grad):
            self._stash[id(param)] = (param, param.grad.clone())
            param.grad = None
        return None

    def _launch(self, bucket):
        bucket.complete = bucket.pending == 0
        if bucket.complete:
            grads = [p.grad for p in bucket.params]
        else:
            grads = [self._contribution(bucket, i) for i in range(len(bucket.params))]
        # Gradients outside the bucket (and the zeros of missing ones) go in with one call.
        outside = [i for i, g in enumerate(grads) if g is None or not bucket.is_view(i, g)]
        if outside:
            for i in outside:
                if grads[i] is not None and grads[i].is_sparse:
                    raise RuntimeError("Sparse gradients (nn.Embedding(sparse=True)) are not "
                                       "supported by the gradient reducer; use dense "
                                       "gradients.")
            with torch.no_grad():
                _ops.pack(bucket.flat, [grads[i] for i in outside],
                          [bucket.offsets[i] for i in outside],
                          [bucket.numels[i] for i in outside])
            for i in outside:
                if grads[i] is not None:
                    bucket.params[i].grad = bucket.views[i]
        flags = bucket.flat[bucket.flags_at:]
        if bucket.complete:
            flags.fill_(1)
        else:
            flags.copy_(torch.tensor([0 if g is None else 1 for g in grads],
                                     dtype=bucket.dtype))
        if self._synced_part:
            for i, p in enumerate(bucket.params):
                if grads[i] is not None and id(p) in self._synced_part:
                    bucket.views[i].sub_(self._synced_part[id(p)][1])
        wire = self._to_wire(bucket)
        hold(wire)
        bucket.work = self._comm.cross_device_ops.all_reduce_async(wire, self._comm.group)
        self._stats_launched += 1
        self._stats_bytes += wire.numel() * wire.element_size()

    def _to_wire(self, bucket):
        """The buffer that is all-reduced: the bucket itself, or its compressed copy (each
        replica's values scaled by 1/N so that the sum stays in the wire dtype's range)."""
        compression = getattr(self._comm.cross_device_ops, "compression", None)
        dtype = wire_dtype(compression, bucket.dtype)
        if dtype is None:
            bucket.wire = None
            return bucket.flat
        if bucket.wire is None or bucket.wire.dtype != dtype:
            bucket.wire = torch.empty(bucket.flat.numel(), dtype=dtype, device=bucket.device)
        _ops.pack(bucket.wire, [bucket.flat], [0], [bucket.flat.numel()],
                  1.0 / self._comm.world_size)
        return bucket.wire

    def _finalize(self):
        try:
            if self._any_ready:
                for bucket in self._buckets[self._next_launch:]:
                    self._launch(bucket)
                self._next_launch = len(self._buckets)
                waited = 0.0
                for bucket in self._buckets:
                    start = time.perf_counter()
                    with explained_failures("the gradient all-reduce", self._comm.rank):
                        bucket.work.wait()
                    waited += time.perf_counter() - start
                    if bucket.wire is not None:
                        _ops.unpack(bucket.wire, [bucket.flat], [0],
                                    float(self._comm.world_size))
                    self._settle(bucket)
                self._local_ids.clear()
                self._steps += 1
                self._stats = ReductionStats(
                    bytes_reduced=self._stats_bytes, num_buckets=self._stats_launched,
                    num_parameters=len(self._params),
                    exposed_communication_seconds=waited,
                    compression=getattr(self._comm.cross_device_ops, "compression", None),
                    steps=self._steps)
                if self._arrival is not None:
                    self._rebuild_from_arrival()
            # Gradients set aside for a backward that accumulated nothing (autograd.grad).
            for param, kept in self._stash.values():
                param.grad = kept if param.grad is None else param.grad + kept
        finally:
            self._stash = {}
            self._queued = False
            self._any_ready = False
            self._next_launch = 0
            self._stats_launched = 0
            self._stats_bytes = 0
            for bucket in self._buckets:
                bucket.reset()

    def _kept(self, param):
        """The already-summed gradient to add back after this sum, or None."""
        if id(param) in self._stash:
            return self._stash.pop(id(param))[1]
        return self._synced_part.pop(id(param), (None, None))[1]

    def _settle(self, bucket):
        """After the all-reduce: every gradient some replica contributed becomes its view
        (which now holds the sum), plus what was set aside before backward."""
        if bucket.complete:
            if self._stash or self._synced_part:
                kept = [(v, self._kept(p)) for p, v in zip(bucket.params, bucket.views)
                        if id(p) in self._stash or id(p) in self._synced_part]
                if kept:
                    torch._foreach_add_([v for v, _ in kept], [k for _, k in kept])
            return
        contributed = bucket.flat[bucket.flags_at:].tolist()
        for position, param in enumerate(bucket.params):
            kept = self._kept(param)
            if contributed[position] <= 0:
                if kept is not None:
                    param.grad = kept  # no replica produced a gradient: leave it as it was
                continue
            view = bucket.views[position]
            current = param.grad
            if current is not None and not bucket.is_view(position, current):
                view.add_(current)     # .grad held an older sum: add the new sum to it
            param.grad = view
            if kept is not None:
                view.add_(kept)
