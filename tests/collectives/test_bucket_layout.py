"""The reducer's bucket layout policy on its own (``torchstrategy._C.compute_bucket_layout``,
csrc/bucket_layout.h): which parameters share a bucket, in which order, at which offsets.

Each bucket comes back as (parameter indices, slot offsets in elements, elements up to the
end of the last slot); the expected numbers are worked out by hand in the comments."""
import pytest
import torch
import torch.nn as nn

from torchstrategy import _C

F32, F16, F64, U8 = "Float/cpu", "Half/cpu", "Double/cpu", "Byte/cpu"
MIB = 1 << 20


def layout(order, numels, element_sizes, keys, first_cap_bytes, cap_bytes):
    """The layout as plain lists, for exact comparison."""
    return [(list(params), list(offsets), elements) for params, offsets, elements in
            _C.compute_bucket_layout(order, numels, element_sizes, keys, first_cap_bytes,
                                     cap_bytes)]


def test_a_bucket_is_closed_when_the_next_parameter_would_pass_its_cap():
    # 4 fp32 parameters of 4 elements (16 bytes) under a 32-byte cap: two per bucket.
    assert layout([0, 1, 2, 3], [4] * 4, [4] * 4, [F32] * 4, 32, 32) == [
        ([0, 1], [0, 4], 8),
        ([2, 3], [0, 4], 8),
    ]


def test_the_order_given_is_the_slot_and_launch_order():
    # Slots follow `order`, not the parameter indices: 3 (2 elements), then 0 at the next
    # 16-byte boundary (4 elements in), 2 at 8. In the first bucket (cap 48 bytes, 36
    # reached) 1 still joins, at 12; in a second bucket (cap 48) it would not fit: a bucket
    # of its own.
    assert layout([3, 0, 2, 1], [4, 9, 1, 2], [4] * 4, [F32] * 4, 48, 48) == [
        ([3, 0, 2, 1], [0, 4, 8, 12], 21),
    ]
    assert layout([5, 3, 0, 2, 1], [4, 9, 1, 2, 2, 4], [4] * 6, [F32] * 6, 16, 48) == [
        ([5], [0], 4),
        ([3, 0, 2], [0, 4, 8], 9),
        ([1], [0], 9),
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


def test_a_parameter_larger_than_the_cap_gets_a_bucket_of_its_own():
    # 64-byte caps; the first bucket is full with parameter 0 (64 bytes). Parameter 2 is 400
    # bytes: it closes the bucket before it, and the one after it cannot join it.
    assert layout([0, 1, 2, 3], [16, 2, 100, 3], [4] * 4, [F32] * 4, 64, 64) == [
        ([0], [0], 16),
        ([1], [0], 2),
        ([2], [0], 100),
        ([3], [0], 3),
    ]


def test_the_first_bucket_takes_the_gradient_that_crosses_its_cap():
    # DDP's rule for the first bucket: it takes parameters until it has reached its cap (64
    # bytes), the one crossing it included, however large (parameter 1, 400 bytes), so that
    # a large first gradient is sent at once. The second bucket (cap 1000) never passes its
    # cap: parameter 3 (1200 bytes) opens its own.
    assert layout([0, 1, 2, 3, 4], [2, 100, 3, 300, 1], [4] * 5, [F32] * 5, 64, 1000) == [
        ([0, 1], [0, 4], 104),
        ([2], [0], 3),
        ([3], [0], 300),
        ([4], [0], 1),
    ]
    # Below its cap the first bucket keeps taking parameters; at the cap it is closed.
    assert layout([0, 1, 2], [4, 4, 4], [4] * 3, [F32] * 3, 20, 1000) == [
        ([0, 1], [0, 4], 8),
        ([2], [0], 4),
    ]


def test_mixed_dtypes_never_share_a_bucket():
    # One bucket per dtype, in the order each dtype first appears. Offsets are in elements
    # of the bucket's dtype: fp32 rounds to 4 elements, fp16 to 8, fp64 to 2, uint8 to 16.
    assert layout([0, 1, 2, 3, 4, 5], [3, 5, 1, 9, 2, 17], [4, 2, 4, 2, 8, 1],
                  [F32, F16, F32, F16, F64, U8], MIB, MIB) == [
        ([0, 2], [0, 4], 5),
        ([1, 3], [0, 8], 17),
        ([4], [0], 2),
        ([5], [0], 17),
    ]


def test_the_same_dtype_on_another_device_is_another_bucket():
    assert layout([0, 1, 2], [4] * 3, [4] * 3, [F32, "Float/cuda:0", F32], MIB, MIB) == [
        ([0, 2], [0, 4], 8),
        ([1], [0], 4),
    ]


def test_the_first_cap_is_the_first_bucket_s_whatever_its_dtype():
    # first cap 8 bytes, cap 64. fp16 parameter 0 (8 bytes) opens bucket 0; fp32 1 opens
    # bucket 1; fp16 2 would take bucket 0 to (8 + 4) * 2 = 24 bytes > 8: bucket 2; fp32 3
    # joins bucket 1 ((4 + 4) * 4 = 32 bytes <= 64). Launch order is opening order.
    assert layout([0, 1, 2, 3], [4] * 4, [2, 4, 2, 4], [F16, F32, F16, F32], 8, 64) == [
        ([0], [0], 4),
        ([1, 3], [0, 4], 8),
        ([2], [0], 4),
    ]


@pytest.mark.parametrize("element_size, offsets", [
    (1, [0, 16, 32]),
    (2, [0, 8, 16]),
    (4, [0, 4, 8]),
    (8, [0, 2, 4]),
    (16, [0, 1, 2]),
])
def test_every_slot_starts_on_a_16_byte_boundary(element_size, offsets):
    # One-element parameters: each slot starts 16 bytes after the previous one.
    assert layout([0, 1, 2], [1] * 3, [element_size] * 3, ["k"] * 3, MIB, MIB) == [
        ([0, 1, 2], offsets, offsets[-1] + 1),
    ]


def test_slots_are_aligned_and_disjoint_for_uneven_sizes():
    numels = [1, 3, 5, 7, 11, 13, 17, 19, 23, 29]
    sizes = [1, 2, 4, 8, 2, 4, 1, 8, 2, 4]
    keys = [f"dtype{size}" for size in sizes]
    buckets = layout(list(reversed(range(10))), numels, sizes, keys, 64, 256)
    assert sorted(i for params, _, _ in buckets for i in params) == list(range(10))
    for params, offsets, elements in buckets:
        end = 0
        for i, offset in zip(params, offsets):
            assert offset * sizes[i] % 16 == 0
            assert offset >= end
            end = offset + numels[i]
        assert elements == end


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
    # Reducer.bucket_layout() reports, per bucket, the parameters, the slots' offsets (each
    # on a 16-byte boundary) and sizes, where the flags start (one per parameter from the
    # next 16-byte boundary) and the flat buffer's elements.
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(5, dtype=torch.float16)),
              nn.Parameter(torch.ones(2, 2)), nn.Parameter(torch.ones(7))]
    reducer = _C.Reducer(64, 16, 1, "", None, None, None)
    reducer.add_parameters(params)
    order = [2, 1, 0, 3]
    reducer.build(order)
    # fp32 2 (16 bytes) fills the 16-byte first bucket; fp16 1 opens bucket 1; fp32 0
    # opens bucket 2 and fp32 3 joins it at 4 ((4 + 7) * 4 = 44 bytes <= 64).
    expected = [([2], [0], 4), ([1], [0], 5), ([0, 3], [0, 4], 11)]
    assert layout(order, [p.numel() for p in params], [p.element_size() for p in params],
                  [F32, F16, F32, F32], 16, 64) == expected
    assert reducer.bucket_order() == [2, 1, 0, 3]
    assert reducer.bucket_sizes() == [1, 1, 2]
    assert reducer.bucket_layout() == [
        ("Float", [2], [0], [4], 4, 4 + 1, ""),
        ("Half", [1], [0], [5], 8, 8 + 1, ""),
        ("Float", [0, 3], [0, 4], [3, 7], 12, 12 + 2, ""),
    ]
