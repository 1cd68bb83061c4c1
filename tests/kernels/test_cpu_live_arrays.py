"""``kernels/cpu/live_arrays.py``: one numpy view per live tensor object, dropped when it dies."""

import numpy as np
import torch

from kernels.cpu.common import kernel_array
from kernels.cpu.live_arrays import live_array, num_live_arrays
from kernels.cpu.vectors import GroupShape


def test_the_same_tensor_gets_the_same_array_sharing_its_memory():
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    a = live_array(t)
    assert live_array(t) is a
    np.testing.assert_array_equal(a, kernel_array(t))
    t.add_(1)  # in place: the cached view sees it
    np.testing.assert_array_equal(a, np.arange(1, 7, dtype=np.float32).reshape(2, 3))


def test_bfloat16_is_viewed_as_bits_like_kernel_array():
    t = torch.randn(4, 8).to(torch.bfloat16)
    a = live_array(t)
    assert a.dtype == np.uint16
    np.testing.assert_array_equal(a, kernel_array(t))


def test_a_dead_tensor_leaves_the_cache_and_a_new_one_never_gets_its_array():
    before = num_live_arrays()
    arrays = []
    for i in range(50):  # ids of dead tensors are handed out again; each new tensor must get its own view
        t = torch.full((3,), float(i))
        arrays.append(live_array(t).copy())
        np.testing.assert_array_equal(live_array(t), np.full(3, float(i), np.float32))
        del t  # the last reference: the weak-reference callback runs now, no collection needed
    assert num_live_arrays() == before
    assert [a[0] for a in arrays] == [float(i) for i in range(50)]


def test_views_of_one_tensor_are_distinct_objects():
    base = torch.arange(8, dtype=torch.float32)
    first, second = base[:4], base[4:]
    np.testing.assert_array_equal(live_array(first), [0, 1, 2, 3])
    np.testing.assert_array_equal(live_array(second), [4, 5, 6, 7])


def test_group_shapes_are_made_once_per_shape():
    assert GroupShape.of(3, 64) is GroupShape.of(3, 64)
    assert GroupShape.of(3, 64) is not GroupShape.of(1, 64)
    assert (GroupShape.of(4, 32).rows, GroupShape.of(4, 32).width) == (4, 32)
