"""The bucketed gradient reducer: after ``backward()`` every mirrored gradient is the sum
over replicas.

How it works (the design DDP's reducer made standard):

- Parameters are laid out in *buckets* exactly as DistributedDataParallel lays out its
  own (csrc/bucket_layout.h), so that the same gradients are summed into the same bits
  (gloo's ring adds an element's contributions in an order set by the buffer's size and
  the element's place in it). Until the first synchronised backward every parameter of a
  dtype and device shares one bucket, in registration order. After it the buckets are
  rebuilt once in the order gradients actually arrived (replica 0's order, broadcast, so
  every replica has the same buckets): one dtype and device per bucket, the slots packed
  back to back; a bucket takes gradients until it has reached its cap, the one crossing
  it included: 1 MiB for the first (so communication starts early), ``bucket_cap_bytes``
  (25 MiB) for the others.
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
- The reduction of a full bucket is the pipeline's one replaceable stage. By default the
  core launches the all-reduce on the c10d process group itself. Otherwise it calls the
  reducer's `_launch_bucket(index, buffer)`, which hands the stage the bucket as a
  `GradBucket` (its buffer, parameters, slot offsets and flags, from the layout the core
  computed: DDP's ``GradBucket``): error-feedback compression
  (``compression=ts.PowerSGD(rank=4)`` or ``ts.Int8()``: an `ErrorFeedbackStage`,
  `torchstrategy.collectives.error_feedback`, which reduces it compressed when the core
  waits for it, after backward, or with ``overlap=True`` starts compressing and sending
  it at once, while backward goes on), or another
  algorithm's ``all_reduce_async`` (``ts.ReductionToOneDevice``, ``ts.HierarchicalCopyAllReduce``,
  ``NcclAllReduce(num_packs=k)``).
- With ``compression="auto"`` the first synchronised steps run uncompressed while an
  `AutoCompressionProbe` times them; at its choice the reducer switches its reduction
  (`_use_compression`: a new core with the same buckets) on every replica at once.

Beside the buckets, one small tensor carries a flag per parameter: 1 if this replica
contributed a gradient for it. It is all-reduced once per synchronised backward, after the
last bucket (outside the buckets, which hold DDP's values and nothing else). Its sum tells
whether *any* replica contributed; a parameter no replica used keeps its ``.grad``
untouched (None stays None), exactly as without a strategy, and a parameter used on only
some replicas gets the sum of theirs. When every parameter of a bucket got its gradient
here (the usual case) the flags are not read back, nor waited for when the core launches on
the process group (the next step marks its own in a second buffer).

Gradient accumulation. What a ``.grad`` holds before a synchronised backward was already
summed by the previous one (or zeroed), so it is kept as it is and only this backward's
new gradients are summed: two synchronised ``backward()`` calls without ``zero_grad()``
give ``g1_sum + g2_sum``, never N times the first. Under ``no_sync()`` gradients accumulate
locally; the next synchronised backward sums everything accumulated since.

The hot path is C++ (``csrc/reducer.cpp``, the bucket layout in ``csrc/bucket_layout.cpp``;
``torchstrategy._C.Reducer``): the hooks, the bookkeeping, the launches through the c10d
process group (or through a Python `CrossDeviceOps`' ``all_reduce_async`` when the strategy
uses another algorithm or compression stage) and the settling of gradients; Python runs
once per backward, to explain collective failures.

Averaging (DDP's convention, `torchstrategy.scale_mean_loss`). A backward that calls
`GradientReducer.average_this_backward` (from an autograd node: the mean loss's) leaves the
*average* over replicas instead of the sum, computed as DistributedDataParallel computes
it: each gradient is divided by the number of replicas as it enters its bucket (times
``1/N`` while copied, divided by ``N`` where it already lives there), then the buckets are
all-reduced with SUM. A bucket launched before the call (a branch of the graph that does
not lead through the mean loss) is divided after its sum. Under ``no_sync()`` nothing is
marked: the synchronising backward decides, and divides everything accumulated since, as
DDP does. Only this backward's new gradients are divided; an older sum kept in ``.grad``
is added back as it is.

Because gradients are views, a ``.grad`` tensor kept from one step is overwritten by the
next step's gradients (as with DDP's ``gradient_as_bucket_view``): clone it to keep it.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from torchstrategy import _compat, _ops, module_state, runtime
from torchstrategy.collectives.auto_compression import AutoChoice, AutoCompressionProbe
from torchstrategy.collectives.communicator import Communicator, explained_failures
from torchstrategy.collectives.compression import (AutoCompression, Compression, ErrorFeedback,
                                                   GradBucket, check_runs_error_feedback)
from torchstrategy.collectives.cross_device_ops import CrossDeviceOps, NcclAllReduce, Pending
from torchstrategy.collectives.error_feedback import ErrorFeedbackStage
from torchstrategy.collectives.stats import ReductionStats

logger = logging.getLogger("torchstrategy")

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


# A bucket as the C++ core lays it out: (dtype, parameter indices, slot offsets, slot
# sizes, its first flag in the core's flags(), elements of the flat buffer, wire dtype or
# "").
_CoreBucket = tuple[str, list[int], list[int], list[int], int, int, str]


def _process_group_for_cpp(cross_device_ops: CrossDeviceOps,
                           group: torch.distributed.ProcessGroup | None
                           ) -> torch.distributed.ProcessGroup | None:
    """The c10d process group the C++ reducer launches on directly, or None when buckets
    must go through the cross-device ops' Python ``all_reduce_async``."""
    if type(cross_device_ops) is not NcclAllReduce or cross_device_ops.num_packs != 1:
        return None
    return group if group is not None else _compat.default_process_group()


class GradientReducer:
    """Sums the gradients of the registered parameters across replicas during backward.

    Args:
      communicator: the strategy's `Communicator` (its cross-device ops do the all-reduce,
        and their ``compression`` picks the wire dtype).
      bucket_cap_bytes: the largest bucket (25 MiB by default).
      first_bucket_bytes: the cap of the first bucket (1 MiB), so that the first all-reduce
        starts as soon as the last layers' gradients exist.
    """

    def __init__(self, communicator: Communicator,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES) -> None:
        if bucket_cap_bytes <= 0:
            raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes}.")
        self._comm = communicator
        runtime.current().track_reducer(self)
        self._cap = int(bucket_cap_bytes)
        self._params: list[torch.Tensor] = []          # registration order
        # param -> its registration index, by identity (the parameters are kept alive, so
        # none can be mistaken for another).
        self._index: module_state.IdentityMap[torch.Tensor, int] = module_state.IdentityMap()
        cross_device_ops = communicator.cross_device_ops
        self._compression: Compression = getattr(cross_device_ops, "compression", None)
        # compression="auto": the first steps run uncompressed while the probe times them,
        # then `_use_compression` switches to the mode it chose (auto_compression.py).
        self._auto: AutoCompressionProbe | None = None
        if isinstance(self._compression, AutoCompression):
            check_runs_error_feedback(cross_device_ops, self._compression)
            self._auto = AutoCompressionProbe(self._compression, communicator)
            self._compression = None
        # A state loaded under "auto" before the choice: applied if the choice is the
        # mode that saved it (`_use_compression`).
        self._pending_state: dict[str, Any] | None = None
        # The stage that reduces a full bucket when the core does not launch it on the
        # process group itself: error-feedback compression, or the algorithm's Python
        # all_reduce_async.
        self._error_feedback: ErrorFeedbackStage | None = None
        self._stage: Callable[[GradBucket], Pending]
        if isinstance(self._compression, ErrorFeedback):
            check_runs_error_feedback(cross_device_ops, self._compression)
            self._error_feedback = ErrorFeedbackStage(self._compression, communicator.group)
            self._stage = self._error_feedback.launch
        else:
            self._stage = lambda bucket: cross_device_ops.all_reduce_async(
                bucket.buffer, communicator.group)
        # The step's "contributed" flags, when the core does not sum them itself: summed
        # by the strategy's algorithm, before any error-feedback stage runs (which reads
        # them through GradBucket.flags).
        self._sum_flags: Callable[[torch.Tensor], Pending] = \
            lambda flags: cross_device_ops.all_reduce_async(flags, communicator.group)
        self._layout: list[_CoreBucket] = []     # the core's buckets, in launch order
        this = weakref.ref(self)   # the C++ reducer must not keep this object alive

        def finalize() -> None:
            reducer = this()
            if reducer is not None:
                reducer._finalize()

        def launch_bucket(index: int, buffer: torch.Tensor) -> Pending:
            reducer = this()
            if reducer is None:
                raise RuntimeError("torchstrategy: a bucket was launched after its gradient "
                                   "reducer was garbage-collected.")
            return reducer._launch_bucket(index, buffer)

        def make(process_group: Any, wire: str, cap: int, first: int) -> Any:
            return _ops.make_reducer(cap, first, communicator.world_size, wire,
                                     process_group, launch_bucket, finalize)

        # `rebucket` (autotune.py's search) and `_use_compression` ("auto") build other
        # cores the same way; `close` drops it with the core.
        self._make_core: Callable[[Any, str, int, int], Any] | None = make
        self._core: Any = None    # torchstrategy._C.Reducer; None once closed
        self._core = self._new_core(int(bucket_cap_bytes), int(first_bucket_bytes))
        self._first_cap = int(first_bucket_bytes)
        # True from a registration until the synchronised backward that shows the order
        # gradients arrive in (the buckets are then rebuilt in that order).
        self._awaiting_arrival = False
        self._earlier_steps = 0   # synchronised steps of cores `rebucket` replaced
        self._after_sync: list[Callable[[], None]] = []
        if self._auto is not None:
            self._after_sync.append(self._auto_step)

    def _new_core(self, cap: int, first: int) -> Any:
        """A C++ core with these caps for the current compression: launching buckets on the
        c10d process group itself where it can (the default algorithm, no error
        feedback), else through `_launch_bucket`.

        Raises:
          RuntimeError: the reducer was closed.
        """
        make = self._make_core
        if make is None:
            raise RuntimeError("this gradient reducer was closed (its process group was "
                               "released at exit); it reduces nothing any more.")
        wire = self._compression if isinstance(self._compression, str) else ""
        process_group = None if self._error_feedback is not None else \
            _process_group_for_cpp(self._comm.cross_device_ops, self._comm.group)
        if process_group is not None:
            try:
                return make(process_group, wire, cap, first)
            except (RuntimeError, TypeError):  # a process group C++ cannot take: via Python
                pass
        return make(None, wire, cap, first)

    def _replace_core(self, core: Any) -> None:
        """Moves the registered parameters, the bucket order and the sync state onto
        `core` (made by `_new_core`), between backward passes."""
        old = self._core
        if self._params:
            core.add_parameters(self._params)
        core.set_sync(old.sync())
        self._earlier_steps += old.stats()[3]
        self._core = core
        if self._params:
            self._build(old.bucket_order())
            if self._awaiting_arrival:   # the rebuild in arrival order is still to come
                core.start_recording()

    def close(self) -> None:
        """Drops the C++ core (and with it its reference to the process group); called by
        the runtime before the process group is destroyed at exit.

        The group must be destroyed by the main thread while the interpreter is whole. A
        C++ core still holding it would keep the group alive into the interpreter's
        teardown, where gloo's threads can abort the process ("terminate called without an
        active exception"). A closed reducer's hooks do nothing (they hold only a weak
        reference to the core), and it cannot `rebucket`.
        """
        self._core = None
        self._make_core = None

    def interrupt(self, interrupted: bool) -> None:
        """With `interrupted`, this reducer's wait for a gradient all-reduce on a gloo group
        ends within 0.2 s with an error saying the group's connections were closed (live
        recovery: the group is being abandoned); without, it waits normally again. Safe
        from any thread; nothing for other backends or a closed reducer."""
        core = self._core
        if core is not None:
            core.set_interrupted(interrupted)

    def drain(self, seconds: float) -> bool:
        """Waits up to `seconds` for the all-reduces this reducer left in flight on a gloo
        group (the flags' sum it does not wait for, the buckets of a failed step) to end,
        completed or failed; returns whether all did (True for other backends and a closed
        reducer). Live recovery calls it before it shuts the group's connections down: a
        gloo collective running then can stay stuck until the collective timeout."""
        core = self._core
        return True if core is None else bool(core.drain(seconds))

    # -- set-up -------------------------------------------------------------------------
    def add_parameters(self, params: Iterable[torch.Tensor]) -> None:
        """Registers parameters (those requiring grad; duplicates ignored) and re-buckets
        as DDP's first iteration does: one bucket per dtype and device, in registration
        order. The next synchronised backward records the order gradients arrive in, and
        the buckets are rebuilt once in that order after it, cut at the caps."""
        new = []
        for p in params:
            if p in self._index or not p.requires_grad:
                continue
            self._index[p] = len(self._params)
            self._params.append(p)
            new.append(p)
        if new:
            self._core.add_parameters(new)
            self._build(list(range(len(self._params))), whole=True)
            self._core.start_recording()
            self._awaiting_arrival = True

    def _build(self, order: list[int], whole: bool = False) -> None:
        """Lays the parameters out into buckets in `order` (the core does; `whole`: one
        bucket per dtype and device) and keeps the layout the core returns, which the
        stages' `GradBucket` are made from."""
        self._core.build(order, whole)
        self._layout = [tuple(bucket) for bucket in self._core.bucket_layout()]

    def _rebuild_from_arrival(self, arrival: Iterable[int]) -> None:
        """Rebuilds the buckets in the order gradients arrived in the first synchronised
        backward on replica 0 (broadcast: every replica must have the same buckets);
        parameters that got no gradient follow in reverse registration order."""
        order: list[int] = []
        seen: set[int] = set()
        for i in arrival:
            if i not in seen:
                seen.add(i)
                order.append(i)
        order += [i for i in reversed(range(len(self._params))) if i not in seen]
        (agreed,) = self._comm.broadcast_([torch.tensor(order, dtype=torch.int64)], src=0)
        self._build(agreed.tolist())
        self._awaiting_arrival = False

    def rebucket(self, bucket_cap_bytes: int, first_bucket_bytes: int | None = None) -> None:
        """Re-buckets the registered parameters with new caps, keeping the bucket (launch)
        order. Each gradient element is still summed on its own, so the results do not
        change with the caps (bit for bit with 2 replicas; see docs/gradient_reduction.md).
        Every replica must call it with the same caps, between backward passes. Gradients
        living in the old buckets stay valid; the next synchronised backward moves them
        into the new ones."""
        first = self._first_cap if first_bucket_bytes is None else int(first_bucket_bytes)
        if bucket_cap_bytes <= 0 or first <= 0:
            raise ValueError(f"rebucket: caps must be positive, got bucket_cap_bytes="
                             f"{bucket_cap_bytes}, first_bucket_bytes={first_bucket_bytes}.")
        if self._core is None or self._make_core is None:
            raise RuntimeError("rebucket: this reducer was closed (its process group was "
                               "released at exit); it reduces nothing any more.")
        self._replace_core(self._new_core(int(bucket_cap_bytes), first))
        self._cap, self._first_cap = int(bucket_cap_bytes), first

    # -- compression="auto" -------------------------------------------------------------
    @property
    def auto_compression(self) -> AutoChoice | None:
        """Under ``compression="auto"``, the `AutoChoice` made (the mode, the predicted
        steps and the figures measured); None before it is made and without "auto"."""
        return None if self._auto is None else self._auto.choice

    def _auto_step(self) -> None:
        """At the end of a synchronised backward under "auto": the probe's step; once it
        has chosen, the reducer switches to the chosen mode (on every replica at the same
        step: the probe's figures are agreed)."""
        if self._auto is None or self._auto.choice is not None:
            return
        exposed = float(self._core.stats()[2])
        choice = self._auto.on_synced_step(exposed, self._params, len(self._layout))
        if choice is None:
            return
        self._after_sync.remove(self._auto_step)   # chosen: no call on later steps
        if choice.compression is not None:
            self._use_compression(choice.compression)
        pending, self._pending_state = self._pending_state, None
        if not pending:
            return
        try:
            self.load_state_dict(pending)
        except ValueError as not_its_own:
            if self._comm.rank == 0:
                logger.warning(f"torchstrategy: compression='auto' chose "
                               f"{choice.compression!r}; the error-feedback state loaded "
                               f"before the choice is not its own, so error feedback (if "
                               f"any) starts from zero residuals: {not_its_own}")

    def _use_compression(self, compression: Compression) -> None:
        """Switches the reduction to `compression` (None, a wire dtype, `ts.Int8` or
        `ts.PowerSGD`) between backward passes, with the same buckets; error feedback
        starts from zero residuals. Every replica must switch at the same step."""
        self._compression = compression
        cross_device_ops, group = self._comm.cross_device_ops, self._comm.group
        if isinstance(compression, ErrorFeedback):
            check_runs_error_feedback(cross_device_ops, compression)
            self._error_feedback = ErrorFeedbackStage(compression, group)
            self._stage = self._error_feedback.launch
        else:
            self._error_feedback = None
            self._stage = lambda bucket: cross_device_ops.all_reduce_async(bucket.buffer,
                                                                           group)
        self._replace_core(self._new_core(self._cap, self._first_cap))

    def on_synced_step(self, callback: Callable[[], None]) -> None:
        """Calls `callback()` at the end of every synchronised backward, after the
        all-reduces finished (on every replica: it may run collectives)."""
        self._after_sync.append(callback)

    @property
    def communicator(self) -> Communicator:
        """The `Communicator` the reducer's collectives run on."""
        return self._comm

    # -- inspection ---------------------------------------------------------------------
    @property
    def bucket_cap_bytes(self) -> int:
        """The largest bucket, in bytes."""
        return self._cap

    @property
    def parameters(self) -> list[torch.Tensor]:
        """The registered parameters, in registration order."""
        return list(self._params)

    def launches_on_process_group(self) -> bool:
        """True when buckets go straight to the c10d process group from C++; False when
        they go through the cross-device ops' Python ``all_reduce_async``."""
        return self._core.launches_on_process_group()

    def reduce_all_now(self) -> None:
        """Sums every registered parameter's current ``.grad`` across replicas, exactly as
        the end of a synchronised backward does, without running autograd: every parameter
        is marked ready in bucket order, then the buckets are finalised. Every replica must
        call it at the same point. Benchmarks use it to time the reduction alone."""
        for index in self._core.bucket_order():
            self._core.mark_ready(index)
        self._finalize()

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order."""
        return self._core.bucket_sizes()

    @property
    def bucket_order(self) -> list[torch.Tensor]:
        """The registered parameters in bucket (launch) order."""
        return [self._params[i] for i in self._core.bucket_order()]

    def bucket_layout(self) -> list[tuple[str, list[int], int, str]]:
        """Per bucket: (dtype name, slot sizes, elements of its buffer, wire dtype or "").
        The slots are packed back to back: the buffer holds the gradients and nothing
        else, as DDP's bucket."""
        return [(dtype, list(numels), elements, wire)
                for dtype, _, _, numels, _, elements, wire in self._layout]

    def is_bucket_view(self, param: torch.Tensor) -> bool:
        """True when ``param.grad`` lives in its bucket (no copy at the next all-reduce)."""
        index = self._index.get(param)
        return index is not None and self._core.is_bucket_view(index)

    def stats(self) -> ReductionStats:
        """The `ReductionStats` of the last synchronised backward. Under error-feedback
        compression ``bytes_reduced`` counts what each replica sent (P and Q, int8 levels
        and scales, the uncompressed rest) and ``compression_ratio`` the buckets' bytes
        over that."""
        bytes_reduced, buckets, waited, steps = self._core.stats()
        ratio = 1.0
        if self._error_feedback is not None:
            sent, uncompressed = self._error_feedback.last_bytes
            # The stage's own sends, and the flags the reducer summed for it.
            flags = self._core.flags()
            bytes_reduced = sent + flags.numel() * flags.element_size()
            ratio = uncompressed / bytes_reduced if bytes_reduced else 1.0
        compression = self._compression if isinstance(self._compression, (str, type(None))) \
            else repr(self._compression)
        return ReductionStats(bytes_reduced=bytes_reduced, num_buckets=buckets,
                              num_parameters=len(self._params),
                              exposed_communication_seconds=waited,
                              compression=compression, steps=steps + self._earlier_steps,
                              compression_ratio=ratio, bucket_cap_bytes=self._cap)

    def _launch_bucket(self, index: int, buffer: torch.Tensor) -> Pending:
        """The core's call for full bucket `index` (launch order) whose flat `buffer` it
        does not reduce itself: held until the backend lets go of it, then handed to the
        stage with its layout. Index -1 is the step's "contributed" flags, summed before
        any stage's handle is waited for."""
        self._comm.hold(buffer)
        if index == -1:
            return self._sum_flags(buffer)
        _, indices, offsets, numels, first_flag, _, _ = self._layout[index]
        return self._stage(GradBucket(
            index=index, buffer=buffer, parameters=tuple(self._params[i] for i in indices),
            indices=tuple(indices), offsets=tuple(offsets), numels=tuple(numels),
            flags=self._core.flags().narrow(0, first_flag, len(indices)),
            complete=bool(self._core.bucket_complete(index))))

    # -- error-feedback state -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The error-feedback compression state of every replica (residuals differ between
        replicas): ``{"error_feedback": [replica 0's, replica 1's, ...]}``, each with the
        step counter, the residuals and PowerSGD's Q matrices keyed by parameter
        registration index; ``{}`` without error-feedback compression. Once the buckets were
        rebuilt in arrival order, also ``"bucket_order"`` (registration indices in launch
        order): compression works on whole buckets (Int8's chunks run across slots), so a
        run resumed from the state must compress with the same buckets to equal the run
        that was not interrupted. A collective under compression (every replica calls it at
        the same point), so that a checkpoint written by the chief alone
        (``ts.BackupAndRestore(...).track(reducer=...)``) holds them all."""
        if self._error_feedback is None:
            return {}
        state: dict[str, Any] = {
            "error_feedback": self._comm.gather_objects(self._error_feedback.state_dict())}
        if not self._awaiting_arrival:
            state["bucket_order"] = list(self._core.bucket_order())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores this replica's part of what `state_dict` returned.

        A state saved by another number of replicas is loaded too: each replica takes an
        equal share of the sum of the saved residuals (`ErrorFeedbackStage.spread_over`),
        and rank 0 logs that it did. Under ``compression="auto"`` before its choice, the
        state is kept and loaded when the choice is made, if it chose the mode that saved
        it (else residuals start from zero, with a warning).

        Raises:
          ValueError: a non-empty state without error-feedback compression, a state that is
            not a reducer's, or one saved under another compression.
        """
        if self._error_feedback is None:
            if state and self._auto is not None and self._auto.choice is None:
                # "auto" has not chosen yet: kept for the mode it will choose.
                self._pending_state = state
                return
            if state:
                raise ValueError("This gradient reducer runs no error-feedback compression; "
                                 "its state_dict is empty. Create the strategy with "
                                 "compression=ts.PowerSGD(...) / ts.Int8() to load one.")
            return
        replicas = state.get("error_feedback") if isinstance(state, dict) else None
        if not isinstance(replicas, list) or not replicas:
            raise ValueError(
                f"This is not a gradient reducer's error-feedback state (it has no "
                f"'error_feedback' list of replicas' states): {type(state).__name__}. Load "
                "what reducer.state_dict() returned, or do not load the reducer's state "
                "(compression then restarts from zero residuals).")
        self._restore_bucket_order(state.get("bucket_order"))
        if len(replicas) == self._comm.world_size:
            self._error_feedback.load_state_dict(replicas[self._comm.rank])
            return
        # Another number of replicas (a preemption resumed on more or fewer): the sum of the
        # residuals, what compression still owes the model, is shared out evenly.
        self._error_feedback.load_state_dict(
            ErrorFeedbackStage.spread_over(replicas, self._comm.world_size))
        if self._comm.rank == 0:
            logger.warning(
                f"torchstrategy: the error-feedback state was saved by {len(replicas)} "
                f"replicas and is loaded into {self._comm.world_size}: the sum of their "
                "residuals is shared out evenly (nothing owed is dropped); PowerSGD's Q and "
                "the step counter carry over.")

    def _restore_bucket_order(self, order: Any) -> None:
        """Lays the buckets out in the saved launch `order` (the saving run's rebuilt
        buckets) instead of rebuilding them after the next backward; a state saved
        without one, or for other parameters, leaves the buckets as they are."""
        if not isinstance(order, list) or sorted(order) != list(range(len(self._params))):
            return
        self._build([int(i) for i in order])
        self._awaiting_arrival = False

    # -- averaging ----------------------------------------------------------------------
    def average_this_backward(self) -> bool:
        """Makes the backward running now leave the average over replicas in ``.grad``
        (DDP's arithmetic; see the module docstring). Must be called from inside a backward
        pass (an autograd Function's ``backward``). Under ``no_sync()`` it marks nothing:
        the synchronising backward averages what accumulated if it calls this too.

        Returns:
          True when the reducer takes the averaging on (the caller must not scale the
          gradient); False when it is closed.
        """
        if self._core is None:
            return False
        return bool(self._core.average_this_backward())

    # -- no_sync ------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        previous = self._core.sync()
        self._core.set_sync(False)
        try:
            yield
        finally:
            self._core.set_sync(previous)

    # -- once per backward --------------------------------------------------------------
    def _finalize(self) -> None:
        synced = False
        try:
            with explained_failures("the gradient all-reduce", self._comm.rank,
                                    self._comm.diagnose):
                synced = bool(self._core.finalize())
        finally:
            self._core.reset_step()
            if self._error_feedback is not None:
                self._error_feedback.end_step(synced)
        arrival = self._core.take_arrival()
        if arrival is not None and self._awaiting_arrival:
            self._rebuild_from_arrival(arrival)
        if synced:
            for callback in list(self._after_sync):
                callback()
