"""Variables held by parameter servers: `PSVariable` (on one server) and `ShardedVariable`
(split along dimension 0 over several servers), as ``ts.Variable`` makes them inside a
`ParameterServerStrategy`'s scope.

Both are handles: reading fetches the value from the server(s), ``assign``/``assign_add``
update it there (``assign_add`` is atomic on each server, so concurrent closures can count
with it). Pickled into a scheduled function they stay handles, so a closure running on a
worker reads and updates the same variable.
"""
from __future__ import annotations

from typing import Any

import torch

from torchstrategy.parameter_server import ps_store, remote
from torchstrategy.variables import Variable, VariableAggregation, VariableSynchronization


class PSVariable(Variable):
    """A variable held by one parameter server (see the module docstring)."""

    _layout: remote.Layout   # set by `_from_layout`


    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Made by the strategy (`_from_layout`); Variable.__new__ calls __init__ again with
        # the user's arguments, which must change nothing.
        pass

    @classmethod
    def _from_layout(cls, layout: remote.Layout, name: str,
                     aggregation: VariableAggregation = VariableAggregation.NONE,
                     synchronization: VariableSynchronization = VariableSynchronization.AUTO
                     ) -> PSVariable:
        self = object.__new__(cls)
        self._layout = layout
        self._name = name
        self._trainable = layout.trainable
        self._aggregation = aggregation
        self._synchronization = synchronization
        self._strategy = None
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self)._from_layout,
                (self._layout, self._name, self._aggregation, self._synchronization))

    @property
    def layout(self) -> remote.Layout:
        """Where the variable lives: a `remote.Layout` (its shards and their servers)."""
        return self._layout

    # -- reading ---------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        return self.read_value()

    def read_value(self) -> torch.Tensor:
        """The current value, fetched from the parameter server."""
        return remote.read_full([self._layout])[0]

    @property
    def dtype(self) -> torch.dtype:
        return self._layout.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._layout.shape)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def ps(self) -> str:
        """The rpc name of the parameter server holding this variable (e.g. "ps:0")."""
        return self._layout.shards[0].ps

    # -- writing ---------------------------------------------------------------------------
    def assign(self, value: Any) -> PSVariable:
        """Sets the value on the parameter server; returns self."""
        remote.write_full(self._layout, value)
        return self

    def assign_add(self, delta: Any) -> PSVariable:
        """Adds `delta` on the parameter server (atomically); returns self."""
        delta = torch.as_tensor(delta, dtype=self._layout.dtype)
        shard = self._layout.shards[0]
        remote.call(shard.ps, ps_store.assign_add, (shard.key, delta))
        return self

    def assign_sub(self, delta: Any) -> PSVariable:
        return self.assign_add(-torch.as_tensor(delta, dtype=self._layout.dtype))

    def _ts_checkpoint_value(self) -> torch.Tensor:
        return self.read_value()

    def __repr__(self) -> str:
        return (f"PSVariable(name={self._name!r}, shape={list(self.shape)}, ps={self.ps!r}, "
                f"value={self.read_value()!r})")


class ShardedVariable(PSVariable):
    """A variable split along dimension 0 into shards held by different parameter servers.

    ``variables`` lists the shards (each a `PSVariable`) in row order; reading the whole
    variable concatenates them; ``assign`` splits the value back. An embedding lookup
    (`ts.parameter_server.embedding_lookup`) fetches only the rows it needs.
    """

    @property
    def variables(self) -> list[PSVariable]:
        """The shards, in row order, each a `PSVariable`."""
        out: list[PSVariable] = []
        for i, shard in enumerate(self._layout.shards):
            shape = (shard.rows,) + tuple(self._layout.shape[1:])
            layout = remote.Layout(key=shard.key, shape=shape, dtype=self._layout.dtype,
                                   shards=(remote.Shard(shard.ps, shard.key, 0, shard.rows),),
                                   trainable=self._layout.trainable)
            out.append(PSVariable._from_layout(layout, f"{self._name}/part_{i}",
                                               self._aggregation, self._synchronization))
        return out

    @property
    def ps(self) -> list[str]:  # type: ignore[override]  # several servers: one per shard
        return [s.ps for s in self._layout.shards]

    def assign_add(self, delta: Any) -> ShardedVariable:
        delta = torch.as_tensor(delta, dtype=self._layout.dtype).expand(self._layout.shape)
        remote.wait([remote.call_async(s.ps, ps_store.assign_add, (s.key, part.contiguous()))
                     for s, part in zip(self._layout.shards,
                                        remote.split_rows(self._layout, delta))])
        return self

    def __len__(self) -> int:
        return len(self._layout.shards)

    def __repr__(self) -> str:
        rows = [s.rows for s in self._layout.shards]
        return (f"ShardedVariable(name={self._name!r}, shape={list(self.shape)}, "
                f"shards={rows}, ps={self.ps})")


def embedding_lookup(params: PSVariable, ids: Any) -> torch.Tensor:
    """Rows `ids` of an embedding table held by parameter servers (a `ShardedVariable` or
    `PSVariable`), shaped ``ids.shape + params.shape[1:]``.

    Only the distinct rows in `ids` are fetched, each from the shard holding it (one rpc
    per shard involved). The result does not track gradients; to train an embedding table
    create an ``nn.Embedding`` in the strategy's scope (see docs/parameter_server.md).
    """
    if not isinstance(params, PSVariable):
        raise TypeError(f"embedding_lookup takes a variable made in a ParameterServerStrategy's "
                        f"scope, got {type(params).__name__}.")
    ids = torch.as_tensor(ids)
    unique, rows, inverse = remote.read_rows(params.layout, ids)
    return rows[inverse].reshape(tuple(ids.shape) + tuple(params.layout.shape[1:]))
