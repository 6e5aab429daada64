"""`ShardedParameters`: ShardedStrategy's parameter handling, on torch's FSDP2
(``fully_shard``) and DTensor (see `torchstrategy.strategies.parameters` for the protocol).

When a model is sharded: at one moment, `ShardedParameters.settle`, which the strategy
reaches through one entry point (``extended.settle_recorded_state()``). A model created in
``scope()`` is sharded when the outermost scope exits; one adopted (``strategy.adopt``) or
handed by a Trainer (`prepare_trainer_module`) is sharded there; the start of ``run`` and
this handling's checkpoint methods settle what a scope still open holds before they read
it. Each model is broadcast from replica 0, then ``fully_shard``-ed, its repeated blocks
first (`plan.plan_units`), then the model itself; a model built on meta is materialised
shard by shard (`materialize`). Gradients are summed over the replicas, as the mirrored
strategies' are.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any, Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.modules import module as nn_module

from torchstrategy import mirroring, module_state, ownership
from torchstrategy.collectives.peers import Peers
from torchstrategy.strategies.parameters import ParameterHandling
from torchstrategy.strategies.sharding import (dcp_io, materialize, plan, stale, state, training,
                                               unused)
from torchstrategy.variables import Variable


class ShardedParameters(ParameterHandling):
    """Parameters sharded with FSDP2 (ZeRO-3) instead of mirrored: the modules created in
    scope are recorded (not their tensors) and sharded when the recording settles (`settle`:
    the outermost scope's exit, else the first ``run``, ``adopt``, Trainer set-up or
    checkpoint of this handling), and FSDP2 reduces their gradients (no gradient reducer).
    Buffers and non-trainable variables are mirrored (`ParameterHandling`'s defaults).

    Args:
      mesh: the `DeviceMesh` parameters are sharded over (1-D: all replicas; 2-D:
        replicate x shard).
      shard_modules: `plan.check_shard_modules`'s result (None: the default policy).
      fsdp_kwargs: ``fully_shard``'s keyword arguments (mesh included).
      activation_checkpointing: recompute each unit's forward in backward (every unit
        but the model itself; `training.checkpoint_activations`).
      init_fn: initialises one module of a model built on meta (None: its
        ``reset_parameters()``; `sharding.materialize`).
      same_parameters_every_step: the user's word that every replica uses the same
        parameters in every step: FSDP2's own reduce-scatter, without `sharding.unused`'s
        zero gradients and mask exchange (which make replicas that used different
        parameters sum as one device would).
    """

    EXTENDED_MEMBERS = frozenset({"mesh", "fsdp_kwargs", "sharded_models", "save_checkpoint",
                                  "load_checkpoint", "export_state_dict",
                                  "adopt_submodules"})

    def __init__(self, mesh: DeviceMesh, shard_modules: Sequence[Any] | None,
                 fsdp_kwargs: dict[str, Any], activation_checkpointing: bool = False,
                 init_fn: materialize.InitFn | None = None,
                 same_parameters_every_step: bool = False) -> None:
        super().__init__()
        self._mesh = mesh
        self._shard_modules = shard_modules
        self._fsdp_kwargs = fsdp_kwargs
        self._activation_checkpointing = activation_checkpointing
        self._init_fn = init_fn
        self._same_parameters_every_step = same_parameters_every_step
        # Weak references to the modules that registered a parameter, and to the models
        # sharded so far (in order).
        self._owners: list[weakref.ref[torch.nn.Module]] = []
        self._roots: list[weakref.ref[torch.nn.Module]] = []
        self._sharding = False
        self._stale = stale.stale_parameters()

    # -- facts ---------------------------------------------------------------------------
    @property
    def mesh(self) -> DeviceMesh:
        """The `DeviceMesh` parameters are sharded over."""
        return self._mesh

    @property
    def fsdp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every ``fully_shard`` call gets (a copy)."""
        return dict(self._fsdp_kwargs)

    def sharded_models(self) -> list[torch.nn.Module]:
        """The models this strategy sharded (still alive), in the order they were
        sharded."""
        return [m for m in (ref() for ref in self._roots) if m is not None]

    # -- recording ---------------------------------------------------------------------
    def record_parameter(self, module: torch.nn.Module, name: str,
                         param: torch.nn.Parameter) -> None:
        """Remembers `module` (weakly; its parameters are read when it is sharded, and no
        reference to an unsharded tensor is kept)."""
        if self._sharding or isinstance(param, DTensor):
            return  # fully_shard registering the sharded parameters
        self._owners.append(weakref.ref(module))

    def record_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """Remembers, on `child` (its `module_state`, owned by the strategy's extended), the
        module it was attached to in the scope: `_take_new_roots` walks up to each model's
        root through it."""
        if not self._sharding:
            module_state.attach(child, self.extended).parent = weakref.ref(parent)

    def check_variable(self, variable: Variable) -> None:
        if variable.trainable:
            raise ValueError(
                f"ShardedStrategy shards nn.Module parameters; the trainable ts.Variable "
                f"{variable.name!r} would be neither sharded nor have its gradient reduced. "
                "Make it an nn.Parameter of a module created in strategy.scope(), or create "
                "it with trainable=False.")

    def created_in_scope(self, tensor: torch.Tensor) -> bool:
        """True for the (sharded) parameters of the models this strategy sharded, and for
        the buffers and variable tensors it mirrors."""
        if any(p is tensor for model in self.sharded_models() for p in model.parameters()):
            return True
        return super().created_in_scope(tensor)

    def _parent_of(self, module: torch.nn.Module) -> torch.nn.Module | None:
        recorded = module_state.state_of(module, self.extended)
        return None if recorded is None else recorded.parent_module()

    def _take_new_roots(self) -> list[torch.nn.Module]:
        """The top-level modules of everything recorded since the last call (each once, in
        the order their first parameter was registered)."""
        owners, self._owners = self._owners, []
        roots: list[torch.nn.Module] = []
        seen: set[int] = set()
        for ref in owners:
            module = ref()
            while module is not None:
                parent = self._parent_of(module)
                if parent is None:
                    break
                module = parent
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                roots.append(module)
        return roots

    # -- sharding ------------------------------------------------------------------------
    def settle(self) -> None:
        """The moment a model is sharded: shards the models recorded since the last call
        and broadcasts new buffers (and non-trainable variables) from replica 0. Every
        replica calls it at the same points, through ``extended.settle_recorded_state()``
        (the outermost scope's exit; else the first ``run``, ``adopt``, Trainer set-up or
        checkpoint of this handling).

        A model built on the meta device is sharded without values, then each replica
        allocates its shards and initialises them (`sharding.materialize`: each module's
        ``reset_parameters()`` or the strategy's ``init_fn``, the same values for any
        number of replicas).

        Raises:
          ValueError: a ``shard_modules`` entry naming no module, a model sharded by the
            user's own ``fully_shard``, a meta model that cannot be initialised (before
            any collective); replicas that built different models; a module created in
            scope and attached to a model that was already sharded.
        """
        if self._sharding:
            return
        roots = self._take_new_roots()
        ours = self.sharded_models()
        for root in roots:
            if any(root is model for model in ours):
                raise ValueError(
                    f"A module was created in strategy.scope() and attached to "
                    f"{type(root).__name__}, which ShardedStrategy had already sharded. Build "
                    "the whole model inside one scope, before the scope exits and before the "
                    "first strategy.run.")
            _check_not_sharded_by_user(root)
        # Models built on meta: checked before any collective, sharded without values,
        # then materialised shard by shard (`materialize`).
        on_meta = [root for root in roots if materialize.on_meta(root)]
        for root in on_meta:
            materialize.check_materializable(root, self._init_fn)
        plans = plan.plan_units(roots, self._shard_modules)
        if self._activation_checkpointing and plans and not any(units for _, units in plans):
            # Checked before any collective; models sharded together (a LightningModule's
            # children) need one unit between them, a small head beside blocks is fine.
            names = ", ".join(type(root).__name__ for root, _ in plans)
            raise ValueError(
                f"ShardedStrategy(activation_checkpointing=True): {names} "
                f"{'has' if len(plans) == 1 else 'have'} no unit but the model itself to "
                "checkpoint (no repeated blocks). Name the blocks with shard_modules=[...], "
                "or leave activation_checkpointing off.")
        labelled: list[tuple[str, torch.Tensor]] = [
            (f"{type(root).__name__}.{name}", p)
            for root in roots for name, p in root.named_parameters()]
        labelled += self.recorded.take_pending_labelled()
        if not labelled:
            return
        comm = self.communicator
        if comm.world_size > 1:
            # Meta tensors are compared (labelled as such) but not broadcast: they get
            # their values after sharding, the same on every replica.
            mirroring.check_replicas_agree(comm, materialize.meta_labels(labelled))
            with torch.no_grad():
                comm.broadcast_([t for _, t in labelled if not t.is_meta], src=0)
        self._sharding = True
        try:
            for root, units in plans:
                self._shard(root, units)
            materialize.materialize(on_meta, self._shard_device(), comm, self._init_fn)
        finally:
            self._sharding = False

    def _shard_device(self) -> torch.device:
        """Where the shards live: host memory with CPU offload (FSDP2 keeps the sharded
        parameters there and copies each unit to the device to gather it), else the
        replica's device."""
        if isinstance(self._fsdp_kwargs.get("offload_policy"), CPUOffloadPolicy):
            return torch.device("cpu")
        return self.extended.torch_device or torch.device("cpu")

    def _shard(self, root: torch.nn.Module, units: list[torch.nn.Module]) -> None:
        before = dict(root.named_parameters())
        if self._activation_checkpointing:
            for unit in units:
                training.checkpoint_activations(unit)
        sharded: list[FSDPModule] = []
        for unit in units + [root]:
            sharded.append(fully_shard(unit, **self._fsdp_kwargs))
        for module in sharded:
            # Sum, as MirroredStrategy: losses are scaled by the global batch already. A
            # plain SUM (not PREMUL_SUM(1), which gloo lacks), divided by 1 afterwards: a
            # no-op.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        if not self._same_parameters_every_step:
            # Replicas may use different parameters in a step (a branch chosen by the
            # batch): every unit reduces every parameter, and one that no replica used
            # keeps no gradient (`sharding.unused`).
            unused.track(root, self.communicator)
        self._stale.add(root, before)
        # model.load_state_dict(full plain state_dict) keeps each replica's part.
        state.route_full_state_dicts(root)
        self._roots.append(weakref.ref(root))

    # -- running ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def first_run_check(self) -> Iterator[None]:
        """Until a run returns (with one replica too): every module with parameters that
        the run calls must belong to a sharded model, else RuntimeError (its parameters
        would be neither sharded nor have their gradients reduced). ``run`` has sharded
        what the scope recorded before this is entered."""
        managed = {id(m) for root in self.sharded_models() for m in root.modules()}
        handle = nn_module.register_module_forward_pre_hook(
            lambda module, inputs: _check_managed(module, managed))
        try:
            yield
        finally:
            handle.remove()

    def adopt(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
              ) -> torch.nn.Module:
        """``strategy.adopt``: shards `module`, built outside the scope, as if it had been
        built inside (broadcast from replica 0, then ``fully_shard``); `optimizer`, built
        over its unsharded parameters, is switched to the sharded ones. A collective.

        Raises:
          TypeError: `module` not an ``nn.Module``, `optimizer` not an ``Optimizer``.
          RuntimeError: inside ``run``.
          ValueError: an optimizer that already has state (load it after adopting, with
            `load_checkpoint` or `load_state_dict_from_checkpoint`).
        """
        ownership.check_adopt_arguments(module, optimizer)
        if optimizer is not None and any(optimizer.state.values()):
            raise ValueError(
                "ShardedStrategy.adopt: the optimizer already has state for the unsharded "
                "parameters. Adopt the model and a fresh optimizer, then load the state with "
                "strategy.extended.load_checkpoint or load_state_dict_from_checkpoint.")
        self._owners.append(weakref.ref(module))
        self.extended.settle_recorded_state()
        if optimizer is not None:
            self._stale.refresh_optimizer(optimizer)
        return module

    def prepare_trainer_module(self, module: torch.nn.Module) -> None:
        """FSDP2 units gather in forward; a Trainer calls the LightningModule's own step
        methods, so its children are sharded, each as a model (`adopt_submodules`)."""
        self.adopt_submodules(module)

    def adopt_submodules(self, module: torch.nn.Module) -> torch.nn.Module:
        """Shards each direct child of `module` that holds parameters as a model of its
        own, for a wrapper whose methods call its children rather than its own forward (a
        LightningModule's ``training_step``: FSDP2 gathers a unit's parameters in its
        forward). A collective.

        Raises:
          ValueError: `module` holds parameters of its own (they would be used unsharded
            outside any forward): move them into a child module.
        """
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"ShardedStrategy shards the child modules of {type(module).__name__}, but "
                f"it holds parameters itself ({own[:3]}), which its methods would use "
                "unsharded. Move them into a child nn.Module.")
        for child in module.children():
            if next(child.parameters(), None) is not None and not state.is_sharded(child):
                self._owners.append(weakref.ref(child))
                # The child is a model of its own, not part of `module`'s tree.
                recorded = module_state.state_of(child, self.extended)
                if recorded is not None:
                    recorded.parent = None
        self.extended.settle_recorded_state()
        return module

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their (unsharded) gradients locally; the next
        backward outside reduce-scatters everything accumulated (FSDP2's
        ``set_requires_gradient_sync``)."""
        models = [m for m in self.sharded_models() if isinstance(m, FSDPModule)]
        for model in models:
            model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for model in models:
                model.set_requires_gradient_sync(True)

    # -- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Every replica writes its shards of `model` (and `optimizer`) into the directory
        `path` (``torch.distributed.checkpoint``; one file system shared by the replicas).
        A collective."""
        self.extended.settle_recorded_state()
        dcp_io.save(path, model, optimizer, Peers(self.communicator))

    def load_checkpoint(self, path: str | os.PathLike[str], model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer | None = None) -> None:
        """Reads a checkpoint of `save_checkpoint` into `model` (and `optimizer`), written
        by any number of replicas. A collective."""
        self.extended.settle_recorded_state()
        dcp_io.load(path, model, optimizer, Peers(self.communicator))

    def export_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The plain single-device ``state_dict`` of `model`: full tensors on the CPU, no
        DTensors, the keys of the unsharded model (``Net().load_state_dict(it)`` works). A
        collective: the chief gets the dict, the other replicas an empty dict."""
        self.extended.settle_recorded_state()
        return state.export_state_dict(model)

    def _model_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._stale.refresh_optimizer(optimizer)
        ids |= {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [m for m in self.sharded_models()
                  if any(id(p) in ids for p in m.parameters())]
        if len(owners) != 1:
            raise ValueError(
                f"The optimizer's parameters belong to {len(owners)} sharded models: pass "
                "model= (a module holding all of them) to checkpoint it.")
        return owners[0]

    def _steps_sharded(self, optimizer: torch.optim.Optimizer) -> bool:
        """True if `optimizer` holds sharded (DTensor) parameters, once those that sharding
        replaced are switched; an optimizer over plain parameters is checkpointed as is."""
        self._stale.refresh_optimizer(optimizer)
        return any(isinstance(p, DTensor) for group in optimizer.param_groups
                   for p in group["params"])

    def state_dict_for_checkpoint(self, obj: Any, model: torch.nn.Module | None = None) -> Any:
        """What a single-file checkpoint (``BackupAndRestore``, Lightning's) stores for
        `obj`: for a sharded model its plain `export_state_dict`; for an optimizer over
        sharded parameters its full state keyed by parameter name (`model`: the module
        holding them; default: the one sharded model that does); anything else's (an
        optimizer over plain parameters included) ``state_dict()``. A collective for
        sharded objects (every replica calls it; the chief gets the state, the other
        replicas an empty dict)."""
        self.extended.settle_recorded_state()
        if state.is_sharded(obj):
            return state.export_state_dict(obj)
        if isinstance(obj, torch.optim.Optimizer) and (model is not None
                                                       or self._steps_sharded(obj)):
            return state.export_optimizer_state_dict(model or self._model_of(obj), obj)
        return obj.state_dict()

    def load_state_dict_from_checkpoint(self, obj: Any, state_dict: Any,
                                        model: torch.nn.Module | None = None) -> None:
        """Loads what `state_dict_for_checkpoint` returned on the chief into `obj`; every
        replica calls it with the same (full) `state_dict` and keeps its shards."""
        self.extended.settle_recorded_state()
        if state.is_sharded(obj):
            state.load_full_state_dict(obj, state_dict)
        elif isinstance(obj, torch.optim.Optimizer) and (model is not None
                                                         or self._steps_sharded(obj)):
            state.load_full_optimizer_state_dict(model or self._model_of(obj), obj,
                                                 state_dict)
        else:
            obj.load_state_dict(state_dict)


def _check_not_sharded_by_user(root: torch.nn.Module) -> None:
    """Raises if `root`, created in the scope, was sharded by other code (the user's own
    ``fully_shard`` calls, kept from an FSDP2 program)."""
    units = [name or type(m).__name__ for name, m in root.named_modules()
             if isinstance(m, FSDPModule)]
    if units or state.is_sharded(root):
        where = f" (fully_shard was applied to {', '.join(units[:3])}" \
                f"{', ...' if len(units) > 3 else ''})" if units else ""
        raise ValueError(
            f"{type(root).__name__}, created in strategy.scope(), was already sharded by "
            f"other code{where}: remove your fully_shard calls; ShardedStrategy shards "
            "the models created in its scope itself when the scope exits (each repeated "
            "block, then the model; shard_modules=[...] to choose the units, and "
            "fully_shard's options are ShardedStrategy's arguments). Keep "
            "`with torch.device('meta'):` if you build on meta: the strategy materialises "
            "the shards and calls reset_parameters().")


def _check_managed(module: torch.nn.Module, managed: Any) -> None:
    if id(module) in managed or next(module.parameters(recurse=False), None) is None:
        return None
    raise RuntimeError(
        f"strategy.run called a {type(module).__name__} that holds parameters but was not "
        "created in ShardedStrategy's scope(), so its parameters are neither sharded nor "
        "have their gradients reduced. Create every module with parameters inside "
        "`with strategy.scope():`, or shard it after building it: "
        "strategy.adopt(model, optimizer).")
