"""Communicator.broadcast_ over 3 real gloo replicas (every collective bounded by the launch's
timeout) with tensors above and below `DIRECT_BROADCAST_BYTES`, of several dtypes, one
large tensor non-contiguous and one contiguous on some replicas only: every replica ends
with replica src's bits in the very tensors it passed (same objects, same storage, same
strides). And broadcast_state with a large tensor: the receivers get replica 0's bits."""
import hashlib

import torch

import torchstrategy as ts
from tests.helpers.replicas import launch
from torchstrategy.collectives import peers as peers_lib
from torchstrategy.collectives.communicator import DIRECT_BROADCAST_BYTES
from torchstrategy.fault_tolerance.state_broadcast import broadcast_state

SRC = 1


def _numel(dtype, nbytes):
    return nbytes // torch.empty((), dtype=dtype).element_size()


def _tensors(rank):
    """The same names, shapes and dtypes on every replica; values (and, for "layout", the
    memory layout) that differ between replicas."""
    g = torch.Generator().manual_seed(rank)
    big = DIRECT_BROADCAST_BYTES

    def rand(shape, dtype):
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) > 0.5
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype)
        return torch.randint(-2 ** 20, 2 ** 20, shape, generator=g).to(dtype)

    rows = 64
    cols = _numel(torch.float32, 2 * big) // rows
    tensors = {
        "large_f32": rand((_numel(torch.float32, big),), torch.float32),
        "small_f32": rand((7, 3), torch.float32),
        "large_f64": rand((3, _numel(torch.float64, big) // 3 + 5), torch.float64),
        "large_i64": rand((_numel(torch.int64, 3 * big),), torch.int64),
        "small_i64": rand((11,), torch.int64),
        "scalar_f64": rand((), torch.float64),
        "large_bf16": rand((_numel(torch.bfloat16, big) + 1,), torch.bfloat16),
        "just_below_f32": rand((_numel(torch.float32, big) - 1,), torch.float32),
        "large_bool": rand((big + 3,), torch.bool),
        # A transposed view: non-contiguous on every replica.
        "transposed_f32": rand((rows, cols), torch.float32).t(),
        # Non-contiguous on the source only: the replicas must still issue the same
        # collectives.
        "layout_f32": (rand((rows, cols), torch.float32).t() if rank == SRC
                       else rand((cols, rows), torch.float32)),
        "parameter": torch.nn.Parameter(rand((_numel(torch.float32, big) + 9,),
                                             torch.float32)),
    }
    return tensors


def _digest(tensor):
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _replica():
    ts.MirroredStrategy()  # joins the launched world's default process group
    comm = peers_lib.process_group_peers().communicator
    tensors = _tensors(comm.rank)
    before = {name: (t.data_ptr(), t.stride(), t.is_contiguous())
              for name, t in tensors.items()}
    sent = {name: _digest(t) for name, t in tensors.items()}
    order = list(tensors.values())
    returned = comm.broadcast_(order, src=SRC)
    same_objects = all(r is t for r, t in zip(returned, order)) and len(returned) == len(order)
    after = {name: (t.data_ptr(), t.stride(), t.is_contiguous())
             for name, t in tensors.items()}
    # broadcast_state: replica 0's state with large and small tensors; the receivers'
    # are allocated by broadcast_state.
    g = torch.Generator().manual_seed(5)
    state = {"m": torch.randn(_numel(torch.float32, 2 * DIRECT_BROADCAST_BYTES), generator=g),
             "small": torch.arange(5), "lr": 0.1} if comm.rank == 0 else None
    got = broadcast_state(comm, state)
    return comm.gather_objects({
        "sent": sent, "received": {name: _digest(t) for name, t in tensors.items()},
        "in_place": before == after, "same_objects": same_objects,
        "parameter_still_a_parameter": isinstance(tensors["parameter"], torch.nn.Parameter)
        and tensors["parameter"].requires_grad,
        "state": {k: _digest(v) if torch.is_tensor(v) else v for k, v in got.items()},
    })


def test_large_and_small_tensors_get_src_bits_in_place_on_every_replica():
    replicas = launch(_replica, n=3)
    src_bits = replicas[SRC]["sent"]
    # The replicas started with different values (else the test would prove nothing).
    assert all(replicas[0]["sent"][name] != src_bits[name] for name in src_bits)
    for rank, replica in enumerate(replicas):
        assert replica["received"] == src_bits, rank
        assert replica["in_place"], rank
        assert replica["same_objects"], rank
        assert replica["parameter_still_a_parameter"], rank
        assert replica["state"] == replicas[0]["state"], rank
    assert replicas[0]["state"]["lr"] == 0.1
