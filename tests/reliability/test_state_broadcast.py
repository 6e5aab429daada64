"""fault_tolerance/state_broadcast.py: replica 0's optimizer state on every replica of 2
real gloo replicas (what an admission gives a joiner), its tensors sent unpickled: equal
bits, dtypes and structure, and a fresh optimizer loaded with it steps like replica 0's."""
import torch

import torchstrategy as ts
from tests.helpers.replicas import launch
from torchstrategy.collectives import peers as peers_lib
from torchstrategy.fault_tolerance.state_broadcast import broadcast_state


def _trained_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, amsgrad=True)
    for _ in range(3):
        model(torch.randn(4, 5, dtype=torch.float64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _replica():
    ts.MirroredStrategy()  # joins the launched world's default process group
    comm = peers_lib.process_group_peers().communicator
    if comm.rank == 0:
        model, optimizer = _trained_adamw()
        sent = optimizer.state_dict()
    else:
        torch.manual_seed(0)    # the same starting parameters, no state
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1)).double()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
        sent = None
    # The optimizer's state, then the parameters replica 0's training gave (a module's
    # state dict: an OrderedDict).
    state = broadcast_state(comm, sent)
    weights = broadcast_state(comm, model.state_dict() if comm.rank == 0 else None)
    summary = {"groups": state["param_groups"],
               "state": {k: {n: (t.dtype, tuple(t.shape), t.tolist())
                             if torch.is_tensor(t) else t for n, t in v.items()}
                         for k, v in state["state"].items()}}
    if comm.rank != 0:
        optimizer.load_state_dict(state)
        model.load_state_dict(weights)
    # One more step from the same state on both: the same bits.
    torch.manual_seed(1)
    model(torch.randn(4, 5, dtype=torch.float64)).sum().backward()
    optimizer.step()
    summary["after"] = [p.detach().tolist() for p in model.parameters()]
    return comm.gather_objects(summary)


def test_a_fresh_optimizer_gets_replica_zeros_state_and_steps_alike():
    on_0, on_1 = launch(_replica, n=2)
    assert on_1["groups"] == on_0["groups"]
    assert on_0["groups"][0]["lr"] == 0.01 and on_0["groups"][0]["amsgrad"] is True
    assert on_1["state"] == on_0["state"]
    first = on_0["state"][0]
    assert set(first) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert first["step"][0] == torch.float32 and first["step"][2] == 3.0
    assert first["exp_avg"][0] == torch.float64 and first["exp_avg"][1] == (3, 5)
    assert on_1["after"] == on_0["after"]
