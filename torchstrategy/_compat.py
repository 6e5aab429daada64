"""The only module that touches private APIs of torch, torch_xla, Lightning and torch's rpc.

Each function below wraps one private API, says why the public API does not serve, and
names the versions it was checked against. A torch (or torch_xla, or Lightning) upgrade
therefore touches this file alone: run the suite, and where a function breaks, fix it here.

Checked against: torch 2.13.0 (CPU; the core environment), torch 2.9.0 with torch_xla 2.9.0
(the xla environment), torch 2.11 (+cu130, the GPU reference machine: reviewed, same code
paths), lightning / pytorch-lightning 2.5-2.6. The C++ side has its own equivalent,
csrc/compat.h.
"""
from __future__ import annotations

import gc
import multiprocessing.forkserver
import os
import sys
import types
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import rpc
from torch.utils import _pytree

# -- torch.utils._pytree (torch 2.4 - 2.13) -------------------------------------------
# torch's own structure library: flattening here matches what torch.compile and
# torch.distributed see. `torch.utils.pytree` (public) exists only from torch 2.6 and
# lacks nothing we use, but the xla environment's torch 2.9 and older torches all have
# the private module with the same functions.
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map
tree_map_only = _pytree.tree_map_only
TreeSpec = _pytree.TreeSpec


# -- c10d (torch 2.4 - 2.13) --------------------------------------------------------
def default_process_group() -> dist.ProcessGroup:
    """The default `ProcessGroup` object (the C++ reducer launches on it directly).

    `torch.distributed.group.WORLD` is the public handle, but in torch <= 2.13 it is a
    proxy that C++ bindings do not accept as a `c10d::ProcessGroup`; the private getter
    returns the real object.
    """
    return dist.distributed_c10d._get_default_group()


def default_store() -> dist.Store | None:
    """The default group's rendezvous store (`None` when there is none), for the roll call
    that names the replicas missing after a failed collective. There is no public getter."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no default group (yet, or any more)
        return None


def release_group_from_functional_defaults(group: dist.ProcessGroup) -> int:
    """Makes `torch.distributed.nn.functional` let go of `group`; returns how many default
    arguments held it.

    That module writes ``group=group.WORLD`` as the default argument of its ten
    collectives, evaluated when it is imported. torch imports it lazily (``torch._dynamo``
    pulls it in, e.g. at the first ``torch.optim`` optimizer): imported while a default
    group exists, its functions hold that group object for the rest of the process, so
    ``destroy_process_group`` frees neither the group nor gloo's threads, and the group is
    destroyed in the interpreter's teardown instead, where gloo's threads abort the process
    ("terminate called without an active exception"). Those defaults are replaced by None,
    which these functions read as "the default group", as the module meant. Nothing is
    imported here: a module not loaded yet holds nothing. Checked against torch 2.4 - 2.13.
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return 0
    replaced = 0
    for function in list(vars(module).values()):
        defaults = getattr(function, "__defaults__", None)
        if not isinstance(function, types.FunctionType) or not defaults:
            continue
        held = sum(value is group for value in defaults)
        if held:
            function.__defaults__ = tuple(None if value is group else value
                                          for value in defaults)
            replaced += held
    return replaced


def live_process_groups() -> list[dist.ProcessGroup]:
    """Every process group torch.distributed knows in this process (the default one and
    every sub-group, DeviceMesh's included). `_world.pg_map` is the only list of them."""
    return list(dist.distributed_c10d._world.pg_map)


def release_groups_from_device_meshes(groups: list[dist.ProcessGroup]) -> int:
    """Makes every live DeviceMesh and FSDP2 mesh description let go of `groups` (about
    to be destroyed); returns how many references it dropped.

    A DeviceMesh keeps its groups' objects in ``_pg_registry`` and FSDP2 keeps them in its
    mesh infos (``shard_process_group``, ``replicate_process_group``, ...); both live as
    long as the model's DTensor parameters, typically into the interpreter's teardown,
    and so would the groups and gloo's threads after ``destroy_process_group``. The
    objects are found with the garbage collector's list; modules not loaded hold nothing
    (nothing is imported here). A mesh or FSDP2 module released this way cannot run a
    collective any more, which a destroyed group could not either. Checked against torch
    2.6 - 2.13 (DeviceMesh's registry exists from 2.6; before, nothing is found).
    """
    targets = {id(group) for group in groups}
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    fsdp_module = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_common")
    mesh_type = getattr(mesh_module, "DeviceMesh", None)
    info_type = getattr(fsdp_module, "DataParallelMeshInfo", None)
    kinds = tuple(kind for kind in (mesh_type, info_type) if isinstance(kind, type))
    if not targets or not kinds:
        return 0
    released = 0
    for obj in gc.get_objects():
        # The classes' MROs, not isinstance: DeviceMesh's metaclass runs an __instancecheck__
        # that touches the object (and warns on some of torch's own).
        if not any(kind in type(obj).__mro__ for kind in kinds):
            continue
        registry = getattr(obj, "_pg_registry", None)
        if isinstance(registry, dict):
            for name in [name for name, group in registry.items() if id(group) in targets]:
                del registry[name]
                released += 1
        for attribute, value in list(getattr(obj, "__dict__", {}).items()):
            if attribute.endswith("process_group") and id(value) in targets:
                setattr(obj, attribute, None)
                released += 1
    return released


# -- multiprocessing (CPython 3.8 - 3.13) ---------------------------------------------
def stop_forkserver() -> None:
    """Ends multiprocessing's fork server, if this process started one, and waits until it
    has exited (``multiprocessing.forkserver._forkserver._stop``, identical in CPython 3.8
    - 3.13; there is no public API). Left alone, the server notices its parent's exit only
    after the parent is gone, and then takes its own interpreter's teardown (seconds with
    torch imported, on a loaded machine) to end: a job "ended" with a process of its own
    still running. A later fork-server start method starts a new one."""
    try:
        multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]
    except ChildProcessError:  # reaped by someone else already: nothing left to wait for
        pass


# -- tensors (torch 2.4 - 2.13) ------------------------------------------------------
def tensor_use_count(tensor: torch.Tensor) -> int:
    """How many owners the tensor's storage handle has (`Tensor._use_count`): > 1 while a
    backend thread still holds a buffer a collective was given. No public equivalent."""
    return tensor._use_count()  # type: ignore[attr-defined]  # private: not in torch's stubs


# -- autograd (torch 2.4 - 2.13) ----------------------------------------------------
def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Runs `callback()` when the backward pass now executing has finished (all gradients of
    this pass accumulated). Only legal inside a backward hook. The execution engine's
    ``queue_callback`` is the only way to act at the end of a backward pass; there is no
    public API for it (DDP uses the same engine call from C++)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# -- FSDP2 (torch 2.13) -------------------------------------------------------------------
def fsdp_reduces_gradients(module: torch.nn.Module) -> bool:
    """Whether the backward now ending reduce-scatters `module`'s (an FSDP2 model's)
    gradients: False under ``set_requires_gradient_sync(False)`` (``no_sync``), where FSDP2
    accumulates them unreduced. FSDP2 has a setter but no getter; its first parameter group
    holds the flag (``FSDPParamGroup.reduce_grads``; checked against torch 2.13.0). A model
    whose units hold no parameters reduces nothing: False."""
    for unit in module.modules():
        get_state = getattr(unit, "_get_fsdp_state", None)
        group = None if get_state is None else get_state()._fsdp_param_group
        if group is not None:
            return bool(group.reduce_grads)
    return False


# -- nn.Module (torch 2.4 - 2.13) ----------------------------------------------------
def module_buffer(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The buffer `name` registered directly on `module` (None if absent or None).

    `module.get_buffer` raises for a buffer set to None and walks dotted paths; reading the
    registry directly gives the tensor registered right now, which a module may replace
    (BatchNorm's ``num_batches_tracked``) after we recorded it.
    """
    return module._buffers.get(name)


def module_persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the buffers registered directly on `module` that its
    ``state_dict()`` saves (non-persistent ones excluded), in registration order."""
    return [(name, tensor) for name, tensor in module._buffers.items()
            if tensor is not None and name not in module._non_persistent_buffers_set]


# -- torch.distributed.checkpoint (torch 2.13) ------------------------------------------
def dcp_file_extents(metadata: Any) -> dict[str, int]:
    """For a ``torch.distributed.checkpoint`` `Metadata`: each data file it refers to
    (relative to the checkpoint directory) -> the bytes that file must hold at least (the
    end of the last item read from it).

    ``Metadata.storage_data`` is public, but what it maps to is the file-system storage's
    private ``_StorageInfo`` record (``relative_path``, ``offset``, ``length``); no public
    API lists a checkpoint's files. Checked against torch 2.13.0 (FileSystemWriter)."""
    extents: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = info.relative_path
        extents[path] = max(extents.get(path, 0), int(info.offset) + int(info.length))
    return extents


# -- torch.optim (torch 2.4 - 2.13) --------------------------------------------------
def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tells torch's LR schedulers that `optimizer.step()` ran (it ran on the parameter
    servers, not here), so they do not warn that the scheduler stepped first."""
    optimizer._opt_called = True  # type: ignore[attr-defined]  # private: not in torch's stubs


# -- torch.distributed.rpc (torch 2.4 - 2.13) ----------------------------------------
def current_rpc_agent() -> Any:
    """This process's rpc agent. Dynamic membership (a worker that rejoins, a dead worker
    dropped) has no public API: the agent's worker registry is read and updated directly."""
    return rpc.api._get_current_rpc_agent()


# -- torch_xla (2.9.0) -----------------------------------------------------------------
def xla_local_shards(tensor: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """The local shards of a sharded XLA tensor and, for each, (replica, index) of where it
    sits in the global tensor. torch_xla 2.9 has no public accessor for both."""
    import torch_xla  # optional dependency: only the TPU strategy calls this

    shards = torch_xla._XLAC._get_local_shards([tensor])[0]
    places = torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])[0]
    return shards, places


def xla_sharding_spec(tensor: torch.Tensor) -> str:
    """The sharding annotation of an XLA tensor as text ('' when replicated/unsharded)."""
    import torch_xla  # optional dependency: only the TPU strategy calls this

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


# -- Lightning (2.5 - 2.6; both `lightning.pytorch` and `pytorch_lightning`) --------------
def lightning_multiprocessing_launcher(package: str) -> type:
    """Lightning's own spawn launcher class (`_MultiProcessingLauncher`) in `package`
    ("lightning.pytorch" or "pytorch_lightning"): the notebook-mode adapter starts its
    replicas with it, as Lightning's ddp_notebook does. It is private in every release."""
    import importlib  # Lightning is optional: imported only by the adapter, on use

    launchers = importlib.import_module(f"{package}.strategies.launchers.multiprocessing")
    return launchers._MultiProcessingLauncher


# -- torch.distributed.rpc, parameter-server membership (torch 2.13.0) -----------------
def rpc_forget_member(agent: Any, name: str, rank: int) -> None:
    """Removes the dead member `name` (`rank`) from `agent`'s worker registry, so a restarted
    process with the same name can join. torch has no public API to leave a dynamic rpc
    group on behalf of a dead peer; `_update_group_membership(info, [], {}, False)` is what
    the agent itself calls when a member leaves (checked: torch 2.13.0)."""
    agent._update_group_membership(rpc.WorkerInfo(name, rank), [], {}, False)


def reset_rpc_init_counter() -> None:
    """Resets the count of ``init_rpc`` calls in this process. rpc keeps a group's state in
    the store under ``rpc_prefix_<count>/``; every member of one cluster must use the same
    prefix, and a process that joined a cluster before would otherwise use another one.
    No public API (checked: torch 2.13.0, `torch.distributed.rpc._init_counter`)."""
    rpc._init_counter = 0


def tensorpipe_tcp_options(init_method: str, rpc_timeout: float, num_worker_threads: int
                           ) -> rpc.TensorPipeRpcBackendOptions:
    """TensorPipe options restricted to the "uv" (TCP) transport and the "basic" channel, so
    an rpc world opens nothing but TCP listeners on the chosen interface. The transport and
    channel lists are private keyword arguments (`_transports`, `_channels`; checked: torch
    2.13.0)."""
    return rpc.TensorPipeRpcBackendOptions(
        init_method=init_method, rpc_timeout=rpc_timeout,
        num_worker_threads=num_worker_threads, _transports=["uv"], _channels=["basic"])


def lightning_optimizers_to_device(package: str, optimizers: list[torch.optim.Optimizer],
                                   device: torch.device) -> None:
    """Moves the optimizers' state to `device`, as Lightning's own strategies do after
    ``setup_optimizers`` (``_optimizers_to_device`` of lightning.fabric /
    lightning_fabric, private in every release)."""
    import importlib  # Lightning is optional: imported only by the adapter, on use

    fabric = {"lightning.pytorch": "lightning.fabric",
              "pytorch_lightning": "lightning_fabric"}[package]
    importlib.import_module(f"{fabric}.utilities.optimizer")._optimizers_to_device(
        optimizers, device)


def lightning_restore_from_checkpoint(trainer: Any, path: str) -> None:
    """Starts Lightning's resume (what ``fit(ckpt_path=path)`` does) from a callback's
    ``setup``, where the path is first known: loads the checkpoint and restores model and
    callbacks; the Trainer then restores loops, optimizers and schedulers from it. The
    checkpoint connector is private in every release. ``weights_only=True``: a backup holds
    tensors and plain values only (RNG states included), so a planted pickle runs nothing."""
    trainer._checkpoint_connector._restore_modules_and_callbacks(path, weights_only=True)


# -- Lightning's and the process's globals, as the Lightning adapter must set them --------
def set_lightning_rank_zero(rank_zero_only_functions: tuple[Any, ...], rank: int) -> None:
    """Sets ``rank_zero_only.rank``, the process-wide attribute Lightning's
    ``@rank_zero_only`` (logging, checkpoint callbacks, progress bars) reads to decide
    whether this process is the chief. Lightning has no setter: its own strategies assign
    the attribute in ``set_world_ranks``, as the adapter must (checked: lightning 2.5-2.6,
    lightning_utilities 0.11-0.15)."""
    for function in rank_zero_only_functions:
        function.rank = rank


def launcher_variable(name: str) -> str | None:
    """The process's environment variable `name` (LOCAL_RANK, LOCAL_WORLD_SIZE, ...), or
    None. The Lightning adapter reads torchrun's variables where no torchstrategy world
    describes the process: in a replica started by Lightning's multiprocessing launcher
    (notebooks), the only place Lightning gives the replica its rank is LOCAL_RANK."""
    return os.environ.get(name)


def publish_launcher_variables(variables: dict[str, str]) -> None:
    """Sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR) in the
    process's environment, for a replica started by Lightning's multiprocessing launcher
    (notebooks), which sets only LOCAL_RANK, MASTER_ADDR and MASTER_PORT: torch.distributed's
    ``env://`` rendezvous and torchstrategy's world detection read the others from there,
    as under torchrun."""
    os.environ.update(variables)


def lightning_parsed_devices(trainer: Any) -> Any:
    """The Trainer's ``devices`` argument as Lightning parsed it (an int of CPU processes, a
    list of GPU indices, ...; ``"auto"`` already replaced by the accelerator's device
    count), for the adapter to refuse devices that disagree with the strategy it wraps.
    Lightning hands a strategy that has its own ``parallel_devices`` no form of the
    argument at all and keeps it only in its accelerator connector's ``_devices_flag``
    (private in every release; checked: lightning 2.5-2.6)."""
    return trainer._accelerator_connector._devices_flag


def set_lightning_launcher(strategy: Any, launcher: Any) -> None:
    """Sets the launcher Lightning's ``fit`` runs the strategy under (None: the replicas
    are already running). ``Strategy.launcher`` has no setter; Lightning's own strategies
    assign ``_launcher`` in ``_configure_launcher``, as the adapter must (checked:
    lightning 2.5-2.6)."""
    strategy._launcher = launcher
