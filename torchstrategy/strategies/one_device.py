"""`OneDeviceStrategy`: variables, computation and input on one device."""
from __future__ import annotations

from typing import Sequence

import torch

from torchstrategy.collectives.communicator import Communicator
from torchstrategy.collectives.cross_device_ops import NcclAllReduce
from torchstrategy.devices import parse_devices
from torchstrategy.strategies.base import Strategy
from torchstrategy.strategies.data_parallel import DataParallelExtended
from torchstrategy.strategies.parameters import MirroredParameters


class OneDeviceStrategy(Strategy):
    """Runs everything on `device` ("cpu", "cuda:1", a torch.device, or TF's "/gpu:0").

    One replica: modules created in ``scope()`` land on `device`, distributed input is moved
    there, ``run`` returns plain values. Useful to test code written for a strategy before
    switching to a distributed one.
    """

    def __init__(self, device: str | torch.device) -> None:
        (parsed,) = parse_devices([device])
        torch_device = parsed.torch_device
        communicator = Communicator(None, 0, 1, torch_device, NcclAllReduce())
        super().__init__(DataParallelExtended(self, communicator, torch_device,
                                              MirroredParameters()))
        self._device_name = parsed.name

    @classmethod
    def build_for_trainer(cls, devices: Sequence[torch.device], num_nodes: int, *,
                          name: str) -> OneDeviceStrategy:
        """One replica on the Trainer's one device (``Trainer(strategy="one_device")``).

        Raises:
          ValueError: more than one device or node.
        """
        count = len(devices)
        if count != 1 or num_nodes != 1:
            raise ValueError(
                f"Trainer(strategy={name!r}) runs one replica, but the Trainer "
                f"asks for {count} device(s) on {num_nodes} node(s). Pass "
                "devices=1, or use strategy='mirrored' for several devices.")
        return cls(devices[0])

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self._device_name!r})"
