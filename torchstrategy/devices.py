"""Parsing and checking the `devices` argument of the strategies."""
from __future__ import annotations

import re
from typing import Iterable

import torch

# TensorFlow spellings accepted for people coming from tf.distribute: "/gpu:0",
# "/device:GPU:0", "GPU:0", "/job:localhost/replica:0/task:0/device:CPU:0".
_TF_DEVICE = re.compile(r"^(?:/job:[^/]+(?:/replica:\d+)?(?:/task:\d+)?)?/?(?:device:)?"
                        r"(?P<kind>cpu|gpu)(?::(?P<index>\d+))?$", re.IGNORECASE)
_TORCH_DEVICE = re.compile(r"^(?P<kind>cpu|cuda)(?::(?P<index>\d+))?$")


class ReplicaDevice:
    """One replica's device: the `torch.device` tensors go to, and the logical name.

    Several CPU replicas (``"cpu:0"``, ``"cpu:1"``) are different replicas that all compute
    on the CPU; `torch_device` is ``cpu`` for each of them and `name` tells them apart.
    """

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        self.index = index

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device("cuda", self.index)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplicaDevice) and (self.kind, self.index) == (other.kind,
                                                                                other.index)

    def __hash__(self) -> int:
        return hash((self.kind, self.index))

    def __repr__(self) -> str:
        return self.name


def parse_device(spec: str | torch.device) -> ReplicaDevice:
    """Parses one device (str or torch.device) into a `ReplicaDevice`.

    Raises:
      ValueError: for anything that is not a CPU or CUDA device, with accepted examples.
    """
    if isinstance(spec, torch.device):
        if spec.type not in ("cpu", "cuda"):
            raise ValueError(f"Unsupported device {spec}: MirroredStrategy runs on 'cpu:N' "
                             "or 'cuda:N' devices (TPUs: use TPUStrategy).")
        return ReplicaDevice(spec.type, spec.index or 0)
    if not isinstance(spec, str):
        raise ValueError(f"A device must be a string or torch.device, got {spec!r}.")
    text = spec.strip()
    match = _TORCH_DEVICE.match(text.lower())
    if match:
        return ReplicaDevice(match["kind"], int(match["index"] or 0))
    match = _TF_DEVICE.match(text)
    if match:
        kind = "cuda" if match["kind"].lower() == "gpu" else "cpu"
        return ReplicaDevice(kind, int(match["index"] or 0))
    raise ValueError(f"Malformed device {spec!r}: use 'cuda:0', 'cpu:1', a torch.device, or "
                     "TensorFlow's '/gpu:0' form.")


def parse_devices(devices: str | torch.device | Iterable[str | torch.device]
                  ) -> list[ReplicaDevice]:
    """Parses and checks a list of replica devices.

    Raises:
      ValueError: empty list, a malformed entry, a duplicate, or CPU mixed with CUDA.
      RuntimeError: a CUDA device when torch has no CUDA or the index does not exist.
    """
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ValueError("`devices` is empty: give at least one device, e.g. ['cpu:0'].")
    parsed = [parse_device(d) for d in devices]
    seen = set()
    for original, device in zip(devices, parsed):
        if device in seen:
            raise ValueError(f"Duplicate device {original!r} in {devices}: each replica needs "
                             "its own device (several CPU replicas are 'cpu:0', 'cpu:1', ...).")
        seen.add(device)
    kinds = {d.kind for d in parsed}
    if len(kinds) > 1:
        raise ValueError(f"`devices` mixes CPU and CUDA devices ({devices}); one strategy's "
                         "replicas must all be CPUs or all be GPUs.")
    if "cuda" in kinds:
        if not torch.cuda.is_available():
            raise RuntimeError(f"CUDA device(s) {devices} requested but torch has no usable "
                               "CUDA here; use CPU replicas, e.g. devices=['cpu:0', 'cpu:1'].")
        count = torch.cuda.device_count()
        for original, device in zip(devices, parsed):
            if device.index >= count:
                raise RuntimeError(f"Device {original!r} does not exist: this machine has "
                                   f"{count} CUDA device(s), cuda:0 to cuda:{count - 1}.")
    return parsed


def default_local_devices() -> list[ReplicaDevice]:
    """Every local GPU, or one CPU replica when there is none (as TensorFlow does)."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [ReplicaDevice("cuda", i) for i in range(torch.cuda.device_count())]
    return [ReplicaDevice("cpu", 0)]
