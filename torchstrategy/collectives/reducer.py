"""The bucketed gradient reducer: after ``backward()`` every mirrored gradient is the sum
over replicas.

How it works (the design DDP's reducer made standard):

- Parameters are laid out in *buckets* in reverse registration order (roughly the order in
  which backward produces their gradients), one dtype and device per bucket, each at most
  ``bucket_cap_bytes`` (25 MiB); the first bucket is small so communication starts early.
- A post-accumulate-grad hook on each parameter marks it ready. When every parameter of a
  bucket is ready, the bucket's gradients are packed into one flat buffer (one fused C++
  call) and its all-reduce is launched asynchronously while backward goes on. Buckets are
  launched strictly in bucket order, so every replica issues the same collectives in the
  same order whatever order its gradients arrive in.
- A callback queued on the autograd engine runs when backward finishes: it launches the
  buckets still waiting (parameters that got no gradient this step contribute zeros), waits
  for every all-reduce, and unpacks the sums into ``.grad`` before ``backward()`` returns.

Each bucket carries one extra element per parameter: 1 if this replica contributed a
gradient for it. After the all-reduce that count tells whether *any* replica did; a
parameter no replica used keeps its ``.grad`` untouched (None stays None), exactly as
without a strategy, and a parameter used on only some replicas gets the sum of theirs.

Gradient accumulation. What a ``.grad`` holds before a synchronised backward was already
summed by the previous one (or zeroed), so it is kept as it is and only this backward's
new gradients are summed: two synchronised ``backward()`` calls without ``zero_grad()``
give ``g1_sum + g2_sum``, never N times the first. Under ``no_sync()`` gradients accumulate
locally; the next synchronised backward sums everything accumulated since.
"""
import contextlib

import torch

from torchstrategy import _ops
from torchstrategy.collectives.communicator import explained_failures, hold

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


class _Bucket:
    __slots__ = ("params", "offsets", "numels", "size", "dtype", "device", "flat", "ready",
                 "pending", "work", "index")

    def __init__(self, index, dtype, device):
        self.index = index
        self.params = []
        self.offsets = []
        self.numels = []
        self.size = 0
        self.dtype = dtype
        self.device = device
        self.flat = None
        self.ready = []
        self.pending = 0
        self.work = None

    def add(self, param):
        self.params.append(param)
        self.offsets.append(self.size)
        self.numels.append(param.numel())
        self.size += param.numel()

    def allocate(self):
        # The trailing len(params) elements carry the "contributed" flags.
        self.flat = torch.empty(self.size + len(self.params), dtype=self.dtype,
                                device=self.device)
        self.reset()

    def reset(self):
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = None


class GradientReducer:
    """Sums the gradients of the registered parameters across replicas during backward.

    Args:
      communicator: the strategy's `Communicator` (its cross-device ops do the all-reduce).
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

    # -- set-up -------------------------------------------------------------------------
    def add_parameters(self, params):
        """Registers parameters (those requiring grad; duplicates ignored) and re-buckets."""
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
            self._rebuild_buckets()

    def _rebuild_buckets(self):
        buckets, open_buckets = [], {}
        for p in reversed(self._params):
            key = (p.dtype, p.device)
            bucket = open_buckets.get(key)
            if bucket is not None:
                cap = self._first_cap if bucket.index == 0 else self._cap
                if (bucket.size + p.numel()) * p.element_size() > cap:
                    bucket = None
            if bucket is None:
                bucket = _Bucket(len(buckets), p.dtype, p.device)
                buckets.append(bucket)
                open_buckets[key] = bucket
            bucket.add(p)
        self._slot = {}
        for bucket in buckets:
            bucket.allocate()
            for position, p in enumerate(bucket.params):
                self._slot[id(p)] = (bucket, position)
        self._buckets = buckets
        self._next_launch = 0

    @property
    def bucket_sizes(self):
        """Number of parameters in each bucket, in launch order."""
        return [len(b.params) for b in self._buckets]

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
    def _make_pre_hook(self, param):
        def keep_previous_grad(grad):
            # Runs before autograd adds this backward's gradient to param.grad. A gradient
            # already there was summed by the previous synchronised backward: set it aside
            # so that only the new gradient is summed, and add it back afterwards.
            if param.grad is None or id(param) in self._local_ids:
                return None
            if self._sync:
                self._stash[id(param)] = (param, param.grad)
                param.grad = None
                self._queue_finalize()
            else:
                # A no_sync backward is about to accumulate onto an already-summed
                # gradient: remember that part, so the next synchronised backward sums
                # only what was accumulated locally and adds this back once.
                self._synced_part[id(param)] = (param, param.grad.detach().clone())
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
        param = bucket.params[position]
        if bucket.ready[position]:
            return param.grad
        if id(param) in self._local_ids and param.grad is not None:
            return param.grad  # accumulated under no_sync, not yet summed
        return None

    def _without_synced_parts(self, bucket, grads):
        return [g - self._synced_part[id(p)][1]
                if g is not None and id(p) in self._synced_part else g
                for p, g in zip(bucket.params, grads)]

    def _launch(self, bucket):
        n = bucket.size
        if bucket.pending == 0:
            grads = [p.grad for p in bucket.params]
            bucket.flat[n:].fill_(1)
        else:
            grads = [self._contribution(bucket, i) for i in range(len(bucket.params))]
            flags = torch.tensor([0 if g is None else 1 for g in grads], dtype=bucket.dtype)
            bucket.flat[n:].copy_(flags)
        if self._synced_part:
            grads = self._without_synced_parts(bucket, grads)
        for g in grads:
            if g is not None and g.is_sparse:
                raise RuntimeError("Sparse gradients (nn.Embedding(sparse=True)) are not "
                                   "supported by the gradient reducer; use dense gradients.")
        _ops.pack(bucket.flat, grads, bucket.offsets, bucket.numels)
        hold(bucket.flat)
        bucket.work = self._comm.cross_device_ops.all_reduce_async(bucket.flat,
                                                                   self._comm.group)

    def _finalize(self):
        try:
            if self._any_ready:
                for bucket in self._buckets[self._next_launch:]:
                    self._launch(bucket)
                self._next_launch = len(self._buckets)
                for bucket in self._buckets:
                    with explained_failures("the gradient all-reduce", self._comm.rank):
                        bucket.work.wait()
                    self._unpack(bucket)
                self._local_ids.clear()
            # Gradients set aside for a backward that accumulated nothing (autograd.grad).
            for param, kept in self._stash.values():
                param.grad = kept if param.grad is None else param.grad + kept
        finally:
            self._stash = {}
            self._queued = False
            self._any_ready = False
            self._next_launch = 0
            for bucket in self._buckets:
                bucket.reset()

    def _kept(self, param):
        """(param, the already-summed gradient to add back after this sum) or Nones."""
        if id(param) in self._stash:
            return self._stash.pop(id(param))
        return self._synced_part.pop(id(param), (None, None))

    def _unpack(self, bucket):
        n = bucket.size
        if all(bucket.ready):
            grads = [p.grad for p in bucket.params]
            _ops.unpack(bucket.flat, grads, bucket.offsets)
            kept = [self._kept(p) for p in bucket.params
                    if id(p) in self._stash or id(p) in self._synced_part]
            if kept:
                torch._foreach_add_([p.grad for p, _ in kept], [g for _, g in kept])
            return
        contributed = bucket.flat[n:].tolist()
        for position, param in enumerate(bucket.params):
            kept = self._kept(param)[1]
            if contributed[position] <= 0:
                if kept is not None:
                    param.grad = kept  # no replica produced a gradient: leave it as it was
                continue
            start = bucket.offsets[position]
            total = bucket.flat[start:start + bucket.numels[position]].view_as(param)
            if bucket.ready[position] or (id(param) in self._local_ids
                                          and param.grad is not None):
                param.grad.copy_(total)       # .grad held this replica's contribution
                if kept is not None:
                    param.grad.add_(kept)
            elif param.grad is not None:
                param.grad.add_(total)        # .grad was already summed: add the new sum
            else:
                param.grad = total.clone() if kept is None else total + kept
