"""The reducer's bucket layout policy on its own (``torchstrategy._C.compute_bucket_layout``,
csrc/bucket_layout.h): which parameters share a bucket, in which order, at which offsets.

Each bucket comes back as (parameter indices, slot offsets in elements, elements up to the
end of the last slot); the expected numbers are worked out by hand in the comments, and
checked against torch's own assignment (DistributedDataParallel's), which the layout must
equal for the sums to be DDP's bit for bit."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torchstrategy import _C

F32, F16, F64, U8 = "Float/cpu", "Half/cpu", "Double/cpu", "Byte/cpu"
MIB = 1 << 20


def layout(order, numels, element_sizes, keys, first_cap_bytes, cap_bytes):
    """The layout as plain lists, for exact comparison."""
    return [(list(params), list(offsets), elements) for params, offsets, elements in
            _C.compute_bucket_layout(order, numels, element_sizes, keys, first_cap_bytes,
                                     cap_bytes)]


def test_a_bucket_is_closed_when_it_reaches_its_cap():
    # 4 fp32 parameters of 4 elements (16 bytes) under a 32-byte cap: the second reaches
    # the cap and closes the bucket. Slots are packed back to back.
    assert layout([0, 1, 2, 3], [4] * 4, [4] * 4, [F32] * 4, 32, 32) == [
        ([0, 1], [0, 4], 8),
        ([2, 3], [0, 4], 8),
    ]


def test_the_order_given_is_the_slot_and_launch_order():
    # Slots follow `order`, not the parameter indices: 3 (2 elements), then 0 at 2, 2 at 6,
    # 1 at 7. Bytes 8, 24, 28, then 64: 1 crosses the 48-byte cap and still joins.
    assert layout([3, 0, 2, 1], [4, 9, 1, 2], [4] * 4, [F32] * 4, 48, 48) == [
        ([3, 0, 2, 1], [0, 2, 6, 7], 16),
    ]
    # First cap 16 bytes: 5 (16 bytes) fills it. Then 3, 0, 2 (8 + 16 + 4 = 28 bytes) and 1
    # (36 bytes) crosses 48 and closes the second bucket.
    assert layout([5, 3, 0, 2, 1], [4, 9, 1, 2, 2, 4], [4] * 6, [F32] * 6, 16, 48) == [
        ([5], [0], 4),
        ([3, 0, 2, 1], [0, 2, 6, 7], 16),
    ]


def test_the_first_bucket_has_its_own_smaller_cap():
    # First bucket capped at 16 bytes: one 16-byte parameter; the others share a bucket.
    assert layout([0, 1, 2, 3], [4] * 4, [4] * 4, [F32] * 4, 16, 1000) == [
        ([0], [0], 4),
        ([1, 2, 3], [0, 4, 8], 12),
    ]


def test_a_first_cap_above_the_cap_is_the_cap():
    assert layout([0, 1, 2, 3], [4] * 4, [4] * 4, [F32] * 4, 1000, 32) == \
        layout([0, 1, 2, 3], [4] * 4, [4] * 4, [F32] * 4, 32, 32)


def test_every_bucket_takes_the_gradient_that_crosses_its_cap():
    # DDP's rule: a bucket takes parameters until it has reached its cap, the one crossing
    # it included, however large. First cap 64 bytes: 0 (8 bytes), then 1 (400) crosses it.
    # Cap 1000: 2 (12 bytes), 3 (1200) crosses it; 4 is left in a bucket still open.
    assert layout([0, 1, 2, 3, 4], [2, 100, 3, 300, 1], [4] * 5, [F32] * 5, 64, 1000) == [
        ([0, 1], [0, 2], 102),
        ([2, 3], [0, 3], 303),
        ([4], [0], 1),
    ]
    # A parameter that reaches the cap alone closes its own bucket.
    assert layout([0, 1, 2], [16, 2, 100], [4] * 3, [F32] * 3, 64, 64) == [
        ([0], [0], 16),
        ([1, 2], [0, 2], 102),
    ]


def test_mixed_dtypes_never_share_a_bucket():
    # One bucket per dtype; none reaches its cap, so they come in the order each dtype
    # first appears. Offsets are in elements of the bucket's dtype, packed.
    assert layout([0, 1, 2, 3, 4, 5], [3, 5, 1, 9, 2, 17], [4, 2, 4, 2, 8, 1],
                  [F32, F16, F32, F16, F64, U8], MIB, MIB) == [
        ([0, 2], [0, 3], 4),
        ([1, 3], [0, 5], 14),
        ([4], [0], 2),
        ([5], [0], 17),
    ]


def test_the_same_dtype_on_another_device_is_another_bucket():
    assert layout([0, 1, 2], [4] * 3, [4] * 3, [F32, "Float/cuda:0", F32], MIB, MIB) == [
        ([0, 2], [0, 4], 8),
        ([1], [0], 4),
    ]


def test_each_dtype_s_first_bucket_has_the_first_cap():
    # first cap 8 bytes, cap 64 (DDP keeps a cap sequence per dtype and device). fp16 0 (8
    # bytes) fills the fp16 first bucket; fp32 1 (16 bytes) fills the fp32 one; fp16 2 and
    # fp32 3 open buckets under the 64-byte cap, still open at the end (opening order).
    assert layout([0, 1, 2, 3], [4] * 4, [2, 4, 2, 4], [F16, F32, F16, F32], 8, 64) == [
        ([0], [0], 4),
        ([1], [0], 4),
        ([2], [0], 4),
        ([3], [0], 4),
    ]


def test_closed_buckets_launch_before_buckets_left_open():
    # fp32 0 opens a bucket that stays open; fp16 1 and 2 (16 bytes) reach the 16-byte cap
    # first: that bucket closes first and launches first, as DDP's.
    assert layout([0, 1, 2], [1, 4, 4], [4, 2, 2], [F32, F16, F16], 16, 16) == [
        ([1, 2], [0, 4], 8),
        ([0], [0], 1),
    ]


@pytest.mark.parametrize("seed", range(6))
def test_the_layout_is_ddp_s(seed):
    # torch's own bucket assignment (what DistributedDataParallel's reducer calls), on
    # random sizes: in arrival order with its [first cap, cap] limits (the rebuild after
    # DDP's first iteration) and, for the first iteration, everything in one bucket.
    g = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 40, (), generator=g))
    numels = torch.randint(1, 3000, (count,), generator=g).tolist()
    order = torch.randperm(count, generator=g).tolist()
    tensors = [torch.empty(n) for n in numels]
    first, cap = 4096, 12000
    ddp, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order],
                                                     [first, cap], [], order)
    ours = layout(order, numels, [4] * count, [F32] * count, first, cap)
    assert [params for params, _, _ in ours] == [list(b) for b in ddp]
    for params, offsets, elements in ours:
        ends = [0] + [sum(numels[i] for i in params[:k + 1]) for k in range(len(params))]
        assert offsets == ends[:-1] and elements == ends[-1]


def test_before_the_first_backward_a_dtype_s_parameters_share_one_bucket():
    # DDP's first iteration: one bucket per dtype and device, slots in registration order,
    # buckets launched in the reverse of the order their dtypes first appear.
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(5, dtype=torch.float16)),
              nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(7))]
    reducer = _C.Reducer(16, 16, 1, "", None, None, None)
    reducer.add_parameters(params)
    reducer.build([0, 1, 2, 3], True)
    assert reducer.bucket_layout() == [
        ("Half", [1], [0], [5], 0, 5, ""),
        ("Float", [0, 2, 3], [0, 3, 7], [3, 4, 7], 1, 14, ""),
    ]
    assert reducer.flags().dtype == torch.float32 and reducer.flags().numel() == 4


def test_nothing_to_lay_out():
    assert layout([], [], [], [], MIB, MIB) == []


@pytest.mark.parametrize("order, numels, sizes, keys, message", [
    ([0, 0], [1], [4], [F32], "appears twice"),
    ([1], [1], [4], [F32], "out of range"),
    ([0], [1], [3], [F32], "not a power of two"),
    ([0], [1, 2], [4], [F32], "2 sizes, 1 element sizes and 1 keys"),
])
def test_malformed_input_is_refused(order, numels, sizes, keys, message):
    with pytest.raises(ValueError, match=message):
        layout(order, numels, sizes, keys, MIB, MIB)


def test_the_reducer_lays_out_its_buckets_with_this_policy():
    # Reducer.bucket_layout() reports, per bucket, the parameters, the slots' offsets
    # (packed) and sizes, where its "contributed" flags start in Reducer.flags() (outside
    # the buckets) and the flat buffer's elements: the gradients and nothing else.
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(5, dtype=torch.float16)),
              nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(7))]
    reducer = _C.Reducer(64, 16, 1, "", None, None, None)
    reducer.add_parameters(params)
    order = [2, 1, 0, 3]
    reducer.build(order)
    # fp32 2 (16 bytes) fills the 16-byte first fp32 bucket; fp16 1 opens the first fp16
    # bucket (10 bytes, open); fp32 0 opens a bucket and 3 joins it at 3 ((3 + 7) * 4 = 40
    # bytes < 64, open).
    expected = [([2], [0], 4), ([1], [0], 5), ([0, 3], [0, 3], 10)]
    assert layout(order, [p.numel() for p in params], [p.element_size() for p in params],
                  [F32, F16, F32, F32], 16, 64) == expected
    assert reducer.bucket_order() == [2, 1, 0, 3]
    assert reducer.bucket_sizes() == [1, 1, 2]
    assert reducer.bucket_layout() == [
        ("Float", [2], [0], [4], 0, 4, ""),
        ("Half", [1], [0], [5], 1, 5, ""),
        ("Float", [0, 3], [0, 3], [3, 7], 2, 10, ""),
    ]
    assert reducer.flags().tolist() == [0.0] * 4
