"""What a worker does with a scheduled function: rebuild it, pull, run, and report.

Each closure arrives pickled (see `pickling`). Parameters in it are references to
parameter-server variables; the worker keeps one local tensor per variable and, before the
function runs, refreshes every one the closure uses with a single fetch per parameter
server. Embedding tables (``nn.Embedding`` weights placed on parameter servers) are not
fetched whole: an ``nn.Embedding`` arrives as a `WorkerEmbedding`, whose forward fetches
only the rows it looks up and whose backward records gradients for those rows only. ``optimizer.step()`` inside the function pushes the
gradients (`WorkerOptimizer`) with the optimizer's settings as they were when the function
was scheduled; the parameter servers apply them with the real optimizer.

The result goes back as a `ClosureResult` (the value, or the error with its kind and
traceback), so the coordinator can tell a failing function from a failing worker.
"""
from __future__ import annotations

import dataclasses
import functools
import pickle
import threading
import traceback
from typing import Any, Callable, Optional, Sequence

import torch

from torchstrategy import nest, runtime
from torchstrategy.input.contexts import InputContext
from torchstrategy.parameter_server import pickling, ps_store, remote


@dataclasses.dataclass
class ClosureResult:
    """What running one scheduled function on a worker gave.

    Attributes:
      value: the function's return value (tensors detached, on the CPU) when it succeeded.
      error: the exception it raised (None on success).
      error_kind: "ps" when a parameter server could not be reached, "user" otherwise.
      trace: the worker-side traceback text of `error`.
    """

    value: Any = None
    error: Optional[BaseException] = None
    error_kind: Optional[str] = None
    trace: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


class _WorkerState:
    """What this worker process keeps between closures (``runtime.current().state``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # variable key -> worker-local tensor
        self.local_params: dict[str, torch.Tensor] = {}
        # per-worker value key -> this worker's value
        self.per_worker: dict[str, Any] = {}
        self.running = threading.local()   # .worker_index while a closure runs here


def _state() -> _WorkerState:
    return runtime.current().state("parameter_server.worker_runtime", _WorkerState)


def _local_param(st: _WorkerState, layout: remote.Layout) -> torch.Tensor:
    """The worker-local tensor of `layout`'s variable (`st`: the `_WorkerState`)."""
    with st.lock:
        param = st.local_params.get(layout.key)
        if param is None:
            # An embedding table is never filled here (rows are fetched on demand): empty
            # memory is not touched, so a large table costs no resident memory.
            param = torch.empty(layout.shape, dtype=layout.dtype) if layout.embedding \
                else torch.zeros(layout.shape, dtype=layout.dtype)
            if layout.trainable:
                param = torch.nn.Parameter(param)
            st.local_params[layout.key] = param
    return param


class WorkerOptimizer:
    """The worker-side stand-in for an optimizer over parameter-server parameters.

    ``step()`` sends each parameter's gradient (for embedding tables: the gradients of the
    rows looked up) to the parameter server holding it, one rpc per server, and returns when
    every server has applied it with its copy of the optimizer. ``zero_grad()`` clears the
    local gradients as torch's does.
    """

    def __init__(self, st: _WorkerState, optimizer_key: str,
                 groups: Sequence[Sequence[remote.Layout]], version: int,
                 hyperparameters: Sequence[dict[str, Any]]) -> None:
        self._key = optimizer_key
        self._version = version
        self._hyperparameters = hyperparameters
        self._local_params = st.local_params
        self.param_groups = [dict(hyper, params=[_local_param(st, l) for l in layouts])
                             for layouts, hyper in zip(groups, hyperparameters)]
        self._layouts = [l for layouts in groups for l in layouts]

    def zero_grad(self, set_to_none: bool = True) -> None:
        local_params = self._local_params
        for layout in self._layouts:
            param = local_params[layout.key]
            setattr(param, "_ts_sparse_grads", [])  # ours, on the local tensor
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Pushes the gradients to the parameter servers, which apply them; returns the
        closure's loss (None without a closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # per ps: {key: grad}, {key: (rows, grads)}
        dense: dict[str, dict[str, torch.Tensor]] = {}
        sparse: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        local_params = self._local_params
        for layout in self._layouts:
            param = local_params[layout.key]
            if param.grad is not None:
                for shard, part in zip(layout.shards, remote.split_rows(layout, param.grad)):
                    dense.setdefault(shard.ps, {})[shard.key] = part.detach().contiguous()
            for ids, rows in getattr(param, "_ts_sparse_grads", []):
                for shard in layout.shards:
                    mask = (ids >= shard.start) & (ids < shard.start + shard.rows)
                    if bool(mask.any()):
                        entry = sparse.setdefault(shard.ps, {})
                        local_ids, grads = ids[mask] - shard.start, rows[mask]
                        if shard.key in entry:
                            old_ids, old_grads = entry[shard.key]
                            local_ids = torch.cat([old_ids, local_ids])
                            grads = torch.cat([old_grads, grads])
                        entry[shard.key] = (local_ids, grads)
        servers = sorted(set(dense) | set(sparse))
        remote.wait([remote.call_async(ps, ps_store.apply_gradients,
                                       (self._key, dense.get(ps, {}), sparse.get(ps, {}),
                                        self._version, self._hyperparameters))
                     for ps in servers])
        return loss

    def __repr__(self) -> str:
        return f"WorkerOptimizer({self._key!r})"


class _RowLookup(torch.autograd.Function):
    """Embedding rows fetched from the parameter servers; backward records the gradients
    of the rows looked up on the table's local tensor (``_ts_sparse_grads``)."""

    @staticmethod
    def forward(ctx, table, ids, layout):
        unique, rows, inverse = remote.read_rows(layout, ids)
        ctx.table, ctx.unique, ctx.inverse = table, unique, inverse
        ctx.row_shape = tuple(layout.shape[1:])
        return rows[inverse].reshape(tuple(ids.shape) + ctx.row_shape)

    @staticmethod
    def backward(ctx, grad_output):
        flat = grad_output.reshape((-1,) + ctx.row_shape)
        rows = torch.zeros((ctx.unique.numel(),) + tuple(flat.shape[1:]), dtype=flat.dtype)
        rows.index_add_(0, ctx.inverse.reshape(-1), flat)
        grads = getattr(ctx.table, "_ts_sparse_grads", None)
        if grads is None:
            grads = ctx.table._ts_sparse_grads = []
        grads.append((ctx.unique, rows))
        return None, None, None


class WorkerEmbedding(torch.nn.Embedding):
    """What an ``nn.Embedding`` becomes on a worker: when its table is held by parameter
    servers, forward fetches only the rows looked up (and backward records their
    gradients); otherwise it is the plain embedding."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Set on the tables that arrived as parameter-server references (`_load_reference`).
        layout = getattr(self.weight, "_ts_layout", None)
        if layout is None or not layout.embedding:
            return super().forward(input)
        if self.max_norm is not None:
            # Renormalising in place would write rows back to the servers outside the
            # optimizer: refuse it rather than let workers' copies drift from the table.
            raise ValueError("nn.Embedding(max_norm=...) is not supported for a table held by "
                             "parameter servers; drop max_norm (or clip the looked-up rows in "
                             "the step, e.g. torch.renorm on the output).")
        out = _RowLookup.apply(self.weight, input, layout)
        if self.padding_idx is not None:
            out = out * (input != self.padding_idx).unsqueeze(-1).to(out.dtype)
        return out


_CLASS_MAP = {("torch.nn.modules.sparse", "Embedding"): WorkerEmbedding}


def _load_reference(st: _WorkerState, used: dict[str, remote.Layout], ref: tuple[Any, ...]
                    ) -> Any:
    """The object reference `ref` stands for on this worker (`st`: the `_WorkerState`);
    the layouts of the variables it reads are added to `used` (key -> layout)."""
    kind = ref[0]
    if kind == "param":
        layout = ref[1]
        param = _local_param(st, layout)
        setattr(param, "_ts_layout", layout)  # read by WorkerEmbedding.forward
        used[layout.key] = layout
        return param
    if kind == "optimizer":
        _, key, groups, version, hyperparameters = ref
        for layouts in groups:
            for layout in layouts:
                used[layout.key] = layout
        return WorkerOptimizer(st, key, groups, version, hyperparameters)
    if kind == "per_worker":
        key = ref[1]
        try:
            return st.per_worker[key]
        except KeyError:
            raise RuntimeError(f"This worker has no per-worker value {key!r} (it was "
                               f"restarted and the coordinator has not rebuilt it yet).") from None
    raise ValueError(f"Unknown reference kind {kind!r}.")


def _pull(st: _WorkerState, used: dict[str, remote.Layout]) -> None:
    local_params = st.local_params
    layouts = [l for l in used.values() if not l.embedding]
    if layouts:
        values = remote.read_full(layouts)
        with torch.no_grad():
            for layout, value in zip(layouts, values):
                local_params[layout.key].copy_(value)
    for layout in used.values():
        param = local_params[layout.key]
        setattr(param, "_ts_sparse_grads", [])  # ours, on the local tensor
        param.grad = None


def _detached(value: Any) -> Any:
    def leaf(x: Any) -> Any:
        return x.detach().cpu() if isinstance(x, torch.Tensor) else x
    return nest.map_structure(leaf, value)


def _picklable(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError with its text when the exception itself cannot travel."""
    try:
        pickle.dumps(error)
    except (pickle.PicklingError, TypeError, AttributeError):
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def current_worker_index() -> int:
    """The index of the worker running the scheduled function this is called from.

    Raises:
      RuntimeError: outside a function scheduled by a ClusterCoordinator.
    """
    index = getattr(_state().running, "worker_index", None)
    if index is None:
        raise RuntimeError("experimental_get_current_worker_index() works only inside a "
                           "function scheduled with ClusterCoordinator.schedule (it runs on "
                           "a worker); the coordinator's own code has no worker index.")
    return index


def run_closure(payload: bytes, worker_index: int | None = None) -> ClosureResult:
    """Rpc target on a worker: runs one scheduled function and returns its `ClosureResult`.
    Never raises: an error comes back with kind "ps" when a parameter server could not be
    reached, "user" otherwise. `worker_index` is what `current_worker_index` returns
    while the function runs."""
    st = _state()
    used: dict[str, remote.Layout] = {}
    st.running.worker_index = worker_index
    try:
        fn, args, kwargs = pickling.loads(payload, functools.partial(_load_reference, st, used),
                                          _CLASS_MAP)
        _pull(st, used)
        result = fn(*args, **kwargs)
        return ClosureResult(value=_detached(result))
    except remote.ParameterServerUnavailableError as error:
        return ClosureResult(error=error, error_kind="ps", trace=traceback.format_exc())
    except BaseException as error:  # the function's own error, sent back to the chief
        return ClosureResult(error=_picklable(error), error_kind="user",
                             trace=traceback.format_exc())
    finally:
        st.running.worker_index = None


def create_per_worker_value(key: str, payload: bytes,
                            input_context: tuple[int, int] | None = None) -> bool:
    """Rpc target: calls the pickled ``fn()`` (``fn(ts.InputContext)`` when `input_context`
    is ``(num_workers, worker_index)``) and keeps the result as this worker's value for
    `key`."""
    st = _state()
    # Nothing is pulled for a per-worker value: the layouts it refers to are dropped.
    fn, args, make_iterator = pickling.loads(payload, functools.partial(_load_reference, st, {}),
                                             _CLASS_MAP)
    if input_context is not None:
        args = (InputContext(num_input_pipelines=input_context[0],
                             input_pipeline_id=input_context[1]),)
    value = fn(*args)
    if make_iterator:
        value = iter(value)
    st.per_worker[key] = value
    return True


def make_iterator(key: str, source_key: str) -> bool:
    """Rpc target: this worker's value for `key` becomes ``iter(value of source_key)``."""
    per_worker = _state().per_worker
    per_worker[key] = iter(per_worker[source_key])
    return True
