"""The strategies a training loop that runs once per process (Lightning's Trainer) can ask
for by name: ``Trainer(strategy="mirrored")``.

This is the one table of strategy names outside ``torchstrategy/__init__.py``; the
Lightning adapter and its registration read it and name no strategy themselves. A new
strategy that a Trainer may build adds one `TrainerKind` (its class) to `KINDS` and the
`TrainerName`s that build it, here, and implements ``Strategy.build_for_trainer``. Whether a Trainer can drive it is not written here: it is
the strategy class's ``CAPABILITIES.one_replica_per_process``, the answer the adapter
reads from a built strategy too.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from torchstrategy.strategies.base import Strategy
from torchstrategy.strategies.central_storage import CentralStorageStrategy
from torchstrategy.strategies.mirrored import MirroredStrategy
from torchstrategy.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from torchstrategy.strategies.one_device import OneDeviceStrategy
from torchstrategy.strategies.tpu import TPUStrategy

# Imported when a Trainer builds it, as torchstrategy.ShardedStrategy is: FSDP2 and DTensor
# are slow to import and only ShardedStrategy needs them.
_SHARDED_MODULE = "torchstrategy.strategies.sharded"


def _sharded_strategy() -> type[Strategy]:
    return importlib.import_module(_SHARDED_MODULE).ShardedStrategy


@dataclasses.dataclass(frozen=True)
class TrainerKind:
    """A strategy a Trainer can name.

    Attributes:
      kind: its name for ``LightningStrategy(kind=...)``.
      class_name: the name of its `Strategy` class (for messages).
      load: returns that class (importing its module, for ShardedStrategy).
      start_methods: how its replicas may be started under a Trainer ("popen": built when
        the Trainer is, re-executing the program or joining torchrun; "fork": forked at
        ``fit``).
    """

    kind: str
    class_name: str
    load: Callable[[], type[Strategy]]
    start_methods: tuple[str, ...] = ("popen",)

    def strategy_class(self) -> type[Strategy]:
        """The `Strategy` subclass."""
        return self.load()

    @property
    def runs_under_a_trainer(self) -> bool:
        """True when a loop that runs once per process can drive the strategy: the class's
        ``CAPABILITIES.one_replica_per_process``, the answer a built strategy gives."""
        return self.strategy_class().CAPABILITIES.one_replica_per_process


@dataclasses.dataclass(frozen=True)
class TrainerName:
    """A name registered in Lightning's ``StrategyRegistry``: builds `strategy` with
    `start_method`; `description` is what Lightning lists (and how our registrations are
    recognised in its registry)."""

    name: str
    strategy: TrainerKind
    start_method: str
    description: str


_MIRRORED = TrainerKind("mirrored", "MirroredStrategy", lambda: MirroredStrategy,
                        ("popen", "fork"))
_ONE_DEVICE = TrainerKind("one_device", "OneDeviceStrategy", lambda: OneDeviceStrategy)
_MULTI_WORKER_MIRRORED = TrainerKind("multi_worker_mirrored", "MultiWorkerMirroredStrategy",
                                     lambda: MultiWorkerMirroredStrategy)
_SHARDED = TrainerKind("sharded", "ShardedStrategy", _sharded_strategy)
# Named so that Trainer(strategy="central_storage") / "tpu" gets the reason it cannot run
# (their CAPABILITIES say a Trainer cannot drive them).
_CENTRAL_STORAGE = TrainerKind("central_storage", "CentralStorageStrategy",
                               lambda: CentralStorageStrategy)
_TPU = TrainerKind("tpu", "TPUStrategy", lambda: TPUStrategy)

KINDS: tuple[TrainerKind, ...] = (_MIRRORED, _ONE_DEVICE, _MULTI_WORKER_MIRRORED, _SHARDED,
                                  _CENTRAL_STORAGE, _TPU)

NAMES: tuple[TrainerName, ...] = (
    TrainerName("mirrored", _MIRRORED, "popen",
                "torchstrategy MirroredStrategy: one replica per device, python train.py "
                "re-executes itself for the other replicas (or joins torchrun)"),
    TrainerName("mirrored_notebook", _MIRRORED, "fork",
                "torchstrategy MirroredStrategy with replicas forked at fit (notebooks)"),
    TrainerName("one_device", _ONE_DEVICE, "popen",
                "torchstrategy OneDeviceStrategy: one replica on one device"),
    TrainerName("multi_worker_mirrored", _MULTI_WORKER_MIRRORED, "popen",
                "torchstrategy MultiWorkerMirroredStrategy: several machines under torchrun"),
    TrainerName("central_storage", _CENTRAL_STORAGE, "popen",
                "torchstrategy CentralStorageStrategy"),
    TrainerName("tpu", _TPU, "popen", "torchstrategy TPUStrategy"),
    TrainerName("sharded", _SHARDED, "popen",
                "torchstrategy ShardedStrategy: parameters, gradients and optimizer state "
                "sharded over one replica per device (FSDP2)"),
)


def find_kind(kind: str) -> TrainerKind | None:
    """The `TrainerKind` named `kind`, or None."""
    return next((entry for entry in KINDS if entry.kind == kind), None)


def trainer_kind(kind: str) -> TrainerKind:
    """The `TrainerKind` named `kind`.

    Raises:
      KeyError: no such kind.
    """
    entry = find_kind(kind)
    if entry is None:
        raise KeyError(kind)
    return entry


def kinds_under_a_trainer() -> list[str]:
    """The kinds a Trainer can build, sorted (what an error about a bad kind lists)."""
    return sorted(entry.kind for entry in KINDS if entry.runs_under_a_trainer)
