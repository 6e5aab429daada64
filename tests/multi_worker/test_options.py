"""MultiWorkerMirroredStrategy's options and HierarchicalCopyAllReduce's machine layouts,
with replicas started by ts.launch (one machine standing for several)."""
import datetime

import pytest
import torch
import torch.distributed as dist

import torchstrategy as ts
from tests.helpers.replicas import launch
from torchstrategy.collectives.hierarchical import PIECE_BYTES


def _options_and_layouts():
    options = ts.CommunicationOptions(bytes_per_pack=4096, timeout_seconds=45,
                                      implementation="RING")
    strategy = ts.MultiWorkerMirroredStrategy(communication_options=options)
    rank = strategy.extended.replica_id
    facts = {
        "backend": dist.get_backend(),
        "bucket_cap": strategy.extended.gradient_reducer.bucket_cap_bytes,
        "timeout": dist.distributed_c10d._get_default_group()._get_backend(
            torch.device("cpu")).options._timeout,
        "options": strategy.communication_options,
        "single_machine": (strategy.num_workers, strategy.worker_index, strategy.task_type,
                           strategy.is_chief),
    }
    # Layouts of 4 replicas over machines: two of two, three + one, one machine, and one
    # replica per machine; chunked into 3 packs or not. Sums are exact on integers.
    sums = {}
    for layout in ([0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0], [0, 1, 2, 3]):
        for packs in (1, 3):
            ops = ts.HierarchicalCopyAllReduce(num_packs=packs)
            ops.create_groups(layout, timeout_seconds=45)
            flat = torch.arange(10, dtype=torch.float64) * (rank + 1) + rank
            ops.all_reduce(flat, None)
            sums[(tuple(layout), packs)] = (ops.num_machines, flat)
    # A buffer of several pipelined pieces (and a remainder), through two machines' stages.
    ops = ts.HierarchicalCopyAllReduce()
    ops.create_groups([0, 0, 1, 1], timeout_seconds=45)
    big = torch.arange(2 * PIECE_BYTES // 8 + 5, dtype=torch.float64) * (rank + 1) + rank
    ops.all_reduce(big, None)
    sums["pieces"] = big
    # Buckets in flight together, as the gradient reducer hands them over (every bucket,
    # then a small flags tensor waited for first, then the buckets): one pipeline across
    # them, each exact, whatever order they are waited in.
    sizes = (PIECE_BYTES // 8 + 3, 7, 2 * PIECE_BYTES // 8 + 1)
    buckets = [torch.arange(n, dtype=torch.float64) * (rank + 1) + rank + k
               for k, n in enumerate(sizes)]
    handles = [ops.all_reduce_async(b, None) for b in buckets]
    for k in (1, 2, 0):
        handles[k].wait()
    sums["overlapping"] = buckets
    return facts, sums


def test_options_reach_the_backend_reducer_and_timeout_and_hierarchy_sums_exactly():
    facts, sums = launch(_options_and_layouts, n=4)
    assert facts["backend"] == "gloo"
    assert facts["bucket_cap"] == 4096
    assert facts["timeout"] == datetime.timedelta(seconds=45)
    assert facts["single_machine"] == (1, 0, None, True)
    expected = sum(torch.arange(10, dtype=torch.float64) * (r + 1) + r for r in range(4))
    # One machine, or one replica per machine: a single level, i.e. a plain all-reduce.
    levels = {(0, 0, 1, 1): 2, (0, 0, 0, 1): 2, (0, 0, 0, 0): 1, (0, 1, 2, 3): 1}
    big = sums.pop("pieces")
    for k, got in enumerate(sums.pop("overlapping")):
        torch.testing.assert_close(got, sum(torch.arange(got.numel(), dtype=torch.float64)
                                            * (r + 1) + r + k for r in range(4)),
                                   atol=0, rtol=0, msg=f"overlapping bucket {k}")
    torch.testing.assert_close(big, sum(torch.arange(big.numel(), dtype=torch.float64) * (r + 1)
                                        + r for r in range(4)), atol=0, rtol=0)
    for (layout, packs), (num_machines, got) in sums.items():
        assert num_machines == levels[layout]
        torch.testing.assert_close(got, expected, atol=0, rtol=0, msg=f"{layout} {packs}")


def test_hierarchical_ops_validate_their_arguments():
    with pytest.raises(ValueError, match="num_packs must be a positive int, got 0"):
        ts.HierarchicalCopyAllReduce(num_packs=0)
    assert repr(ts.HierarchicalCopyAllReduce(2)) == \
        "HierarchicalCopyAllReduce(num_packs=2, shared_memory=True)"
