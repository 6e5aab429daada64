"""Replicas that build different parameters are named at scope exit (issue 19, item 3),
instead of gloo aborting the process or equal-sized tensors being silently reinterpreted."""
import pytest
import torch

import torchstrategy as ts
from tests.helpers.replicas import launch


def _different_models(kind):
    strategy = ts.MirroredStrategy()
    rank = strategy.extended.replica_id
    try:
        with strategy.scope():
            if kind == "out_features":
                torch.nn.Linear(4, 2 if rank == 0 else 3)
            elif kind == "transposed":
                torch.nn.Parameter(torch.zeros((2, 4) if rank == 0 else (4, 2)))
                torch.nn.Linear(4, 2).register_parameter(
                    "extra", torch.nn.Parameter(torch.zeros((2, 4) if rank == 0 else (4, 2))))
            elif kind == "dtype":
                torch.nn.Linear(4, 2, dtype=torch.float32 if rank == 0 else torch.float64)
            elif kind == "count":
                torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(1 + rank)])
            else:
                torch.nn.Linear(4, 2)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("kind, expected", [
    ("out_features", "Linear.weight [2, 4] float32 on replica 0 but Linear.weight [3, 4] "
                     "float32 on replica 1"),
    ("transposed", "Linear.extra [2, 4] float32 on replica 0 but Linear.extra [4, 2] "
                   "float32 on replica 1"),
    ("dtype", "Linear.weight [2, 4] float32 on replica 0 but Linear.weight [2, 4] float64 "
              "on replica 1"),
    ("count", "different numbers of mirrored tensors inside strategy.scope(): 2 on replica 0, "
              "4 on replica 1"),
])
def test_different_parameters_are_named_at_scope_exit(kind, expected):
    message = launch(_different_models, kind, n=2)
    assert expected in message, message


def test_identical_models_pass_the_check():
    assert launch(_different_models, "same", n=2) == "no error"
