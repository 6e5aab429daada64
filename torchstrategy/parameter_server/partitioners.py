"""Variable partitioners: how many shards a variable is split into along dimension 0.

The names, arguments and results are TensorFlow's (``tf.distribute.experimental.partitioners``).
A partitioner is called as ``partitioner(shape, dtype)`` and returns a list with one entry per
dimension, all 1 except dimension 0, which holds the number of shards. Rows are then dealt
out as ``torch.tensor_split`` / TensorFlow do: the first ``rows % shards`` shards get one row
more (13 rows over 5 shards: 3, 3, 3, 2, 2).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


def _bytes_per_row(shape: Sequence[int], dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return element * (math.prod(shape[1:]) if len(shape) > 1 else 1)


def _result(shape: Sequence[int], shards: int) -> list[int]:
    return [max(1, shards)] + [1] * (len(shape) - 1)


def shard_rows(rows: int, shards: int) -> list[int]:
    """The number of rows of each shard: ``[3, 3, 3, 2, 2]`` for 13 rows over 5 shards."""
    base, extra = divmod(rows, shards)
    return [base + 1 if i < extra else base for i in range(shards)]


class Partitioner:
    """Base class: ``partitioner(shape, dtype)`` returns the partitions per dimension."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        raise NotImplementedError("abstract: FixedShardsPartitioner, MinSizePartitioner, "
                                  "MaxSizePartitioner implement __call__")


class FixedShardsPartitioner(Partitioner):
    """Splits every variable into `num_shards` shards (fewer when it has fewer rows).

    ``FixedShardsPartitioner(num_shards=5)((13, 4), torch.float32) == [5, 1]``.
    """

    def __init__(self, num_shards: int) -> None:
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be a positive int, got {num_shards!r}.")
        self._num_shards = num_shards

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        shape = tuple(shape)
        if not shape:
            return []
        return _result(shape, min(self._num_shards, shape[0]))


class MinSizePartitioner(Partitioner):
    """As many shards as possible, each at least `min_shard_bytes` (up to `max_shards`).

    Args:
      min_shard_bytes: the smallest a shard may be, in bytes (default 256 KiB).
      max_shards: the most shards to make (usually the number of parameter servers).
      bytes_per_string: ignored (TensorFlow's argument for string variables).
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1,
                 bytes_per_string: int = 16) -> None:
        if min_shard_bytes < 1:
            raise ValueError(f"min_shard_bytes must be positive, got {min_shard_bytes}.")
        if max_shards < 1:
            raise ValueError(f"max_shards must be positive, got {max_shards}.")
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        shape = tuple(shape)
        if not shape:
            return []
        total = shape[0] * _bytes_per_row(shape, dtype)
        # TensorFlow rounds up (min_max_variable_partitioner), and so does this.
        shards = min(self._max_shards, shape[0],
                     max(1, math.ceil(total / self._min_shard_bytes)))
        return _result(shape, int(shards))


class MaxSizePartitioner(Partitioner):
    """As few shards as possible, each at most `max_shard_bytes` (up to `max_shards`).

    Args:
      max_shard_bytes: the largest a shard may be, in bytes.
      max_shards: the most shards to make (None: no limit).
      bytes_per_string: ignored (TensorFlow's argument for string variables).
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None,
                 bytes_per_string: int = 16) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}.")
        if max_shards is not None and max_shards < 1:
            raise ValueError(f"max_shards must be positive, got {max_shards}.")
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        shape = tuple(shape)
        if not shape:
            return []
        row_bytes = _bytes_per_row(shape, dtype)
        rows_per_shard = max(1, self._max_shard_bytes // row_bytes)
        shards = math.ceil(shape[0] / rows_per_shard)
        if self._max_shards is not None:
            shards = min(shards, self._max_shards)
        return _result(shape, int(min(shards, shape[0])))


def num_shards_for(partitioner: Callable[[torch.Size, torch.dtype], Sequence[int]] | None,
                   shape: Sequence[int], dtype: torch.dtype) -> int:
    """Calls `partitioner` and checks its answer; returns the number of shards (>= 1)."""
    shape = tuple(shape)
    if partitioner is None or len(shape) == 0 or shape[0] < 2:
        return 1
    parts = list(partitioner(torch.Size(shape), dtype))
    if len(parts) != len(shape) or any(p != 1 for p in parts[1:]) or parts[0] < 1:
        raise ValueError(f"The variable partitioner returned {parts} for shape {list(shape)}: "
                         f"it must return one entry per dimension, 1 except along "
                         f"dimension 0 (only dimension 0 can be partitioned).")
    return min(int(parts[0]), shape[0])
