"""What resuming a training loop restores besides the objects' state_dicts: the random
generators of every replica, and the position in the data, kept in global batches so that a
run may resume on another number of replicas.

``BackupAndRestore``, ``PreemptionCheckpointHandler`` and the Lightning backup callback
write and check these the same way.
"""
from __future__ import annotations

import logging
import random
import sys
from typing import Any, Mapping

import torch
from torch.utils.data import DataLoader

from torchstrategy.input.distributed_dataset import DistributedDataset

logger = logging.getLogger("torchstrategy")


def rng_state() -> dict[str, Any]:
    """This process's random generators (torch, CUDA if in use, Python, NumPy if imported)
    as tensors and plain values, which a backup stores and `set_rng_state` restores."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        # Plain values (no ndarray), so the backup loads with weights_only=True.
        name, keys, position, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = (str(name), [int(k) for k in keys], int(position), int(has_gauss),
                          float(cached))
    return state


def set_rng_state(state: Mapping[str, Any] | None) -> None:
    """Restores what `rng_state` returned (None: nothing was recorded)."""
    if state is None:  # not recorded (a backup written before any step ran)
        return
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy  # optional dependency: saved only when the program had imported it

        name, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.asarray(keys, dtype=numpy.uint32), position,
                                has_gauss, cached))


def global_batch_size(data: Any) -> int | None:
    """Samples per global batch of `data` (a distributed dataset of a DataLoader, or a
    DataLoader); None when it has no fixed batch size (another iterable)."""
    if isinstance(data, DistributedDataset):
        data = data.dataset  # the loader of global batches it distributes
    if not isinstance(data, DataLoader):
        return None
    if data.batch_size is not None:
        return int(data.batch_size)
    size = getattr(data.batch_sampler, "batch_size", None)
    return int(size) if isinstance(size, int) else None


def check_resize(written_replicas: int | None, replicas: int,
                 global_batches: Mapping[str, tuple[int | None, int | None]],
                 what: str) -> None:
    """Allows resuming on `replicas` replicas a position written by `written_replicas`.

    The position in the data is kept in global batches (steps), which stay the same samples
    whatever the number of replicas: only the per-replica batch changes, from
    ``G / written_replicas`` to ``G / replicas``.

    Args:
      written_replicas: the replicas of the run that wrote the checkpoint (None: unknown).
      replicas: this run's replicas.
      global_batches: ``{name: (G when written, G now)}`` per dataset (None: unknown).
      what: the checkpoint, for messages.

    Raises:
      ValueError: a dataset whose global batch size changed (naming both), or, when the
        number of replicas changed, a global batch that `replicas` does not divide.
    """
    for name, (written, now) in global_batches.items():
        if written is not None and now is not None and written != now:
            raise ValueError(
                f"{what} was written with a global batch of {written} samples for {name}, but "
                f"this run's loader gives global batches of {now}. The position in the data "
                f"is kept in global batches: keep batch_size={written} (each of the "
                f"{replicas} replicas then takes {written}/{replicas}), or start afresh.")
    if written_replicas is None or written_replicas == replicas:
        return
    for name, (_, now) in global_batches.items():
        if now is not None and now % replicas:
            raise ValueError(
                f"{what} was written by {written_replicas} replicas and resumes on "
                f"{replicas}, but the global batch of {name} ({now} samples) does not divide "
                f"into {replicas} equal per-replica batches. Resume on a number of replicas "
                f"that divides {now}, or use a global batch that is a multiple of {replicas} "
                "from the start.")
    sizes = ", ".join(f"{name}: {now} per global batch, {now // replicas} per replica"
                      for name, (_, now) in global_batches.items() if now is not None)
    logger.warning(f"torchstrategy: resuming {what}, written by {written_replicas} replicas, "
                   f"on {replicas} replicas with the same global batch"
                   + (f" ({sizes})" if sizes else "") + ".")
