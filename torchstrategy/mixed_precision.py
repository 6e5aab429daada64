"""`ts.mixed_precision`: Keras's mixed-precision policy for a custom training loop.

Three pieces, with Keras's names, built on torch's own machinery (``torch.autocast`` and
``torch.amp.GradScaler``):

- `Policy("mixed_bfloat16" | "mixed_float16" | "float32")`: computations in the compute
  dtype, variables (parameters) in float32;
- `apply_policy(module, policy)`: the module's forward runs under ``torch.autocast`` with
  the policy's compute dtype, and its floating outputs come back as float32, so the loss
  is computed in float32 (as Keras advises with a float32 last layer, and as Lightning's
  ``precision="bf16-mixed"`` returns them). No autocast is written in the training step;
- `LossScaleOptimizer(optimizer)`: dynamic loss scaling for float16 (``get_scaled_loss``,
  then ``step()``). A step whose gradients hold an inf or NaN is skipped, and the scale
  lowered, on every replica alike: the replicas agree on the overflow with one all-reduce
  of a flag before torch's scaler decides. (The gradient reducer's sum already carries an
  inf of one replica to all of them; the explicit agreement also covers gradients that
  were not summed, e.g. under ``no_sync`` or from ``torch.autograd.grad``.)

bfloat16 has float32's range: it needs no loss scaling (Keras does not scale it either).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from torchstrategy import context
from torchstrategy.reduce_op import ReduceOp

_POLICIES = {"float32": torch.float32, "mixed_bfloat16": torch.bfloat16,
             "mixed_float16": torch.float16}


class Policy:
    """A mixed-precision policy: the dtype layers compute in and the dtype of variables.

    Args:
      name: "mixed_bfloat16" (compute bfloat16: TPUs, recent GPUs, CPUs), "mixed_float16"
        (compute float16, with `LossScaleOptimizer`: GPUs) or "float32" (no mixed
        precision). Keras's names.

    Attributes: name, compute_dtype and variable_dtype (strings, as Keras), and
    torch_compute_dtype (a torch.dtype).

    Raises:
      ValueError: another name, listing the valid ones.
    """

    def __init__(self, name: str) -> None:
        if name not in _POLICIES:
            raise ValueError(f"Policy name {name!r} is not supported; use one of "
                             f"{sorted(_POLICIES)} (Keras's names).")
        self.name = name
        self.torch_compute_dtype = _POLICIES[name]
        self.compute_dtype = str(self.torch_compute_dtype).replace("torch.", "")
        self.variable_dtype = "float32"

    @property
    def needs_loss_scaling(self) -> bool:
        """True for float16, whose small range underflows small gradients."""
        return self.torch_compute_dtype is torch.float16

    def autocast(self, device_type: str) -> torch.autocast:
        """The ``torch.autocast`` context of this policy on `device_type` ("cpu", "cuda",
        ...); it does nothing for "float32"."""
        return torch.autocast(device_type, dtype=self.torch_compute_dtype,
                              enabled=self.torch_compute_dtype is not torch.float32)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f'<Policy "{self.name}">'


def _as_policy(policy: Policy | str) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy(policy)
    raise TypeError(f"policy must be a ts.mixed_precision.Policy or its name, got {policy!r}.")


def _to_variable_dtype(output: Any) -> Any:
    """Floating tensors of `output` (any nesting of tuples, lists, dicts) as float32."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() else output
    if isinstance(output, (list, tuple)):
        items = [_to_variable_dtype(o) for o in output]
        return type(output)(*items) if hasattr(output, "_fields") else type(output)(items)
    if isinstance(output, dict):
        return type(output)((k, _to_variable_dtype(v)) for k, v in output.items())
    return output


class _AutocastForward:
    """A module's forward under its policy's autocast (installed by `apply_policy`)."""

    def __init__(self, module: torch.nn.Module, forward: Callable[..., Any],
                 policy: Policy) -> None:
        self.policy = policy
        self._module = module
        self._forward = forward
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.policy.autocast(_device_type(self._module)):
            output = self._forward(*args, **kwargs)
        return _to_variable_dtype(output)

    def __deepcopy__(self, memo: dict[int, Any]) -> _AutocastForward:
        # copy.deepcopy(model) records the new module in `memo` before copying its
        # attributes: the copy's forward must call the copy, not the original.
        module = memo.get(id(self._module), self._module)
        forward: Any = self._forward   # a bound method of the module, or any callable
        if getattr(forward, "__self__", None) is self._module:
            forward = forward.__func__.__get__(module)
        return _AutocastForward(module, forward, self.policy)


def _device_type(module: torch.nn.Module) -> str:
    for tensor in module.parameters():
        return tensor.device.type
    for buffer in module.buffers():
        return buffer.device.type
    return "cpu"


def apply_policy(module: torch.nn.Module, policy: Policy | str) -> torch.nn.Module:
    """Makes `module`'s forward run in `policy`'s compute dtype; returns `module`.

    Guarantees: the forward runs under ``torch.autocast`` on the device of the module's
    parameters (looked up at each call, so moving the module later is fine); floating
    outputs are returned as float32; parameters, gradients and optimizer state stay float32;
    ``state_dict`` is unchanged. Apply it to the model inside or outside a strategy's scope.

    Raises:
      TypeError: `module` not a torch.nn.Module, or `policy` not a Policy or its name.
      ValueError: a policy applied twice to the same module.
    """
    policy = _as_policy(policy)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"apply_policy takes a torch.nn.Module, got {module!r}.")
    installed = module.__dict__.get("forward")
    if isinstance(installed, _AutocastForward):
        raise ValueError(f"{type(module).__name__} already runs under "
                         f"{installed.policy!r}; apply a policy once.")
    module.forward = _AutocastForward(module, module.forward, policy)
    return module


class LossScaleOptimizer:
    """Dynamic loss scaling around `inner_optimizer`, as Keras's (torch's GradScaler inside).

    Use it in the training step instead of the optimizer::

        optimizer.get_scaled_loss(loss).backward()
        optimizer.step()          # unscales, skips the step on an overflow, adapts the scale
        optimizer.zero_grad()

    Args:
      inner_optimizer: a torch.optim.Optimizer over float32 parameters.
      initial_scale: the first loss scale (Keras's default 2**15).
      dynamic_growth_steps: steps without overflow before the scale doubles (2000).

    The scale halves at every step with an inf or NaN gradient on any replica; that step is
    skipped on every replica. ``state_dict()`` holds the inner optimizer's state and the
    scaler's (scale, growth counter), so a checkpoint resumes with the same scale.

    Raises:
      TypeError / ValueError: a bad argument, named.
    """

    def __init__(self, inner_optimizer: torch.optim.Optimizer, initial_scale: float = 2.0 ** 15,
                 dynamic_growth_steps: int = 2000) -> None:
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{inner_optimizer!r}.")
        if isinstance(initial_scale, bool) or not isinstance(initial_scale, (int, float)) \
                or not 0 < initial_scale < float("inf"):
            raise ValueError(f"initial_scale must be a positive finite number, got "
                             f"initial_scale={initial_scale!r}.")
        if isinstance(dynamic_growth_steps, bool) or not isinstance(dynamic_growth_steps, int) \
                or dynamic_growth_steps < 1:
            raise ValueError(f"dynamic_growth_steps must be a positive integer, got "
                             f"dynamic_growth_steps={dynamic_growth_steps!r}.")
        devices = {p.device.type for g in inner_optimizer.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"The optimizer's parameters are on several device types "
                             f"{sorted(devices)}; one LossScaleOptimizer per device type.")
        self.inner_optimizer = inner_optimizer
        self.dynamic_growth_steps = dynamic_growth_steps
        self._scaler = torch.amp.GradScaler(devices.pop() if devices else "cpu",
                                            init_scale=float(initial_scale),
                                            growth_interval=dynamic_growth_steps)
        # The strategy whose replicas must agree on an overflow: the one in scope now.
        self._strategy = context.get_strategy()
        self._scaled = False   # get_scaled_loss called since the last step

    # -- Keras's interface -----------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale (a float)."""
        return float(self._scaler.get_scale())

    def get_scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the loss scale: call ``.backward()`` on it."""
        self._scaled = True
        return self._scaler.scale(loss)

    def get_unscaled_gradients(self, grads: Sequence[torch.Tensor | None]
                               ) -> list[torch.Tensor | None]:
        """Gradients of the scaled loss (e.g. from ``torch.autograd.grad``) divided by the
        scale; None entries stay None."""
        inverse = 1.0 / self.loss_scale
        return [None if g is None else g * inverse for g in grads]

    def step(self, closure: Callable[[], Any] | None = None) -> bool:
        """Applies the gradients unless one replica's hold an inf or NaN; adapts the scale.

        Returns True when the step was applied (the same on every replica).

        Raises:
          ValueError: a closure (the scaler cannot re-run one with a scaled loss).
          RuntimeError: no get_scaled_loss since the last step (the gradients would be
            unscaled by a scale they were never multiplied by).
        """
        if closure is not None:
            raise ValueError("LossScaleOptimizer.step() takes no closure: compute the loss, "
                             "call get_scaled_loss(loss).backward(), then step().")
        if not self._scaled:
            raise RuntimeError("LossScaleOptimizer.step() without get_scaled_loss(): call "
                               "optimizer.get_scaled_loss(loss).backward() before step(), "
                               "not loss.backward().")
        self._scaled = False
        grads = [p.grad for group in self.param_groups for p in group["params"]
                 if p.grad is not None]
        overflow = self._agreed_overflow(grads)
        if overflow and grads and bool(torch.isfinite(grads[0]).all()):
            # Another replica overflowed: mark one of ours so that torch's scaler skips
            # this step and lowers the scale here exactly as there. The gradients of a
            # skipped step are discarded by zero_grad() anyway.
            with torch.no_grad():
                grads[0].view(-1)[0] = float("inf")
        self._scaler.step(self.inner_optimizer)
        self._scaler.update()
        return not overflow

    def _agreed_overflow(self, grads: Sequence[torch.Tensor]) -> bool:
        """True when any replica's gradients hold an inf or NaN (one all-reduce)."""
        device = grads[0].device if grads else torch.device("cpu")
        local = torch.zeros((), device=device)
        if grads:
            local = (~torch.stack([torch.isfinite(g).all() for g in grads]).all()).float()
        replica = context.get_replica_context()
        strategy = self._strategy
        if replica is not None and replica.num_replicas_in_sync > 1:
            return bool(replica.all_reduce(ReduceOp.SUM, local) > 0)
        if strategy.num_replicas_in_sync > 1:
            return bool(strategy.extended.replica_all_reduce(ReduceOp.SUM, local) > 0)
        return bool(local > 0)

    # -- the optimizer's interface ---------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner_optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.inner_optimizer.state

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict with the scaler's under "loss_scale"."""
        state = dict(self.inner_optimizer.state_dict())
        state["loss_scale"] = self._scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores what `state_dict` returned (the scale included)."""
        state = dict(state_dict)
        scaler_state = state.pop("loss_scale", None)
        if scaler_state is None:
            raise ValueError("This state dict has no 'loss_scale': it was not saved by a "
                             "LossScaleOptimizer. Load it into the inner optimizer instead.")
        self.inner_optimizer.load_state_dict(state)
        self._scaler.load_state_dict(scaler_state)

    def __repr__(self) -> str:
        return (f"LossScaleOptimizer({type(self.inner_optimizer).__name__}, "
                f"loss_scale={self.loss_scale:g})")
