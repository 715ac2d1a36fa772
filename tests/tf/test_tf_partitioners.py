"""TensorFlow's own partitioner tests, run against mpitf.

Origin: tensorflow/python/ops/partitioned_variables_test.py (Apache License 2.0, The
TensorFlow Authors): PartitionerCreatorsTest, and of PartitionedVariablesTestCase the
slice sizes its save specs check; each test below names the TF test it follows. The
shapes, arguments and expected partitions are TF's; the changes:
- imports: mpitf.placement's partitioners; numpy dtypes for ``dtypes.*``.
- no ops (a design choice: mpitf builds no graph): TF reads ``_get_partitions()`` and
  the variable list of a variable made under ``variable_scope(partitioner=...)``; here
  the partitioner is called as TF calls it, ``partitioner(shape=..., dtype=...)``, and
  the slice count and row ranges come from mpitf's `Placement`.
- mpitf places a cut only where each slice is one contiguous row-major range (axis 0,
  or an axis after only length-1 axes; docs/design.md): for the cuts along a later
  axis (``v1``..``v3d``, ``v5_axis``, ``v6_axis``, testRandomInitUnevenPartitions) the
  partitioner's answer is checked, and placing such a cut is refused with a message.
  The uneven sizes of testRandomInitUnevenPartitions are checked on a (1, 43) variable,
  whose axis-1 cut is placeable.
- create_partitioned_variables (deprecated in TF), initializers, names, control
  dependencies and the meta-graph save are graph matters, left out; mpitf's checkpoints
  of partitioned variables are tested in tests/ckpt/test_checkpoint.py.
"""

import numpy as np
import pytest

from mpitf.errors import ConfigurationError
from mpitf.placement import (
    Placement,
    fixed_size_partitioner,
    min_max_variable_partitioner,
    variable_axis_size_partitioner,
)

F32, F64, I64 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)


def placed(partitioner, shape, dtype=F32):
    """Return the (start, stop) rows of each slice of a variable placed on 2 ps tasks."""
    placement = Placement([("v", tuple(shape), dtype.str)], 2, partitioner=partitioner)
    row = int(np.prod(shape)) // next((d for d in shape if d != 1), 1)
    return [(s.start // row, s.stop // row) for s in placement.owner("v")]


# --- PartitionerCreatorsTest -------------------------------------------------------
def test_fixed_size_partitioner():  # testFixedSizePartitioner, testResourceFixedSizePartitioner
    partitioner = fixed_size_partitioner(5, axis=0)
    assert partitioner(shape=(10, 10), dtype=F32) == [5, 1]
    assert len(placed(partitioner, (10, 10))) == 5


def test_fixed_size_partitioner_int64():  # testFixedSizePartitionerInt64
    assert len(placed(fixed_size_partitioner(4, axis=0), [20], I64)) == 4


@pytest.mark.parametrize("name, axis, max_shard_bytes, shards, partitions, max_shards", [
    ("v0", 0, 131072, 1, [1, 1, 1, 1], None),  # no need to slice
    ("v1", 1, 65536, 1, [1, 1, 1, 1], None),  # exactly max_shard_bytes: one slice
    ("v2", 2, 32768, 2, [1, 1, 2, 1], None),
    ("v3a", 3, 2048, 32, [1, 1, 1, 32], None),  # as many shards as the axis allows
    ("v3b", 3, 1024, 32, [1, 1, 1, 32], None),  # and no more
    ("v3c", 3, 1024, 32, [1, 1, 1, 32], 33),  # max_shards that does not bind
    ("v3d", 3, 1024, 2, [1, 1, 1, 2], 2),  # max_shards that does
])
def test_variable_axis_size_partitioner(name, axis, max_shard_bytes, shards, partitions,
                                        max_shards):  # testVariableAxisSizePartitioner
    partitioner = variable_axis_size_partitioner(
        axis=axis, max_shard_bytes=max_shard_bytes, max_shards=max_shards)
    got = partitioner(shape=(4, 8, 16, 32), dtype=F32)
    assert got == partitions and got[axis] == shards
    if shards == 1:
        assert len(placed(partitioner, (4, 8, 16, 32))) == 1
    else:  # a cut along a later axis of (4, 8, 16, 32): refused, see the module docstring
        with pytest.raises(ConfigurationError, match=f"cut along axis {axis}, which mpitf"):
            placed(partitioner, (4, 8, 16, 32))


def test_variable_axis_size_partitioner_strings():  # the v3str case
    partitioner = variable_axis_size_partitioner(
        axis=3, max_shard_bytes=32768, bytes_per_string_element=8)
    assert partitioner(shape=(4, 8, 16, 32), dtype=np.dtype(object)) == [1, 1, 1, 4]


@pytest.mark.parametrize("max_partitions, axis, min_slice_size, shape, partitions", [
    (100, 0, 2 << 10, [2048], [4]),  # v0_0
    (100, 0, 256 << 10, [2048, 1024], [32, 1]),  # v0
    (16, 0, 256 << 10, [2048, 1024], [16, 1]),  # v1_max: max_partitions binds
    (1, 0, 256 << 10, [2048, 1024], [1, 1]),  # v2_max
    (100, 0, 128 << 10, [2048, 1024], [64, 1]),  # v3_slice
    (100, 0, 512 << 10, [2048, 1024], [16, 1]),  # v4_slice
    (100, 1, 256 << 10, [64, 1024, 1, 3], [1, 3, 1, 1]),  # v5_axis
    (100, 3, 256 << 10, [64, 1024, 1, 3], [1, 1, 1, 3]),  # v6_axis
    (100, 0, 256 << 10, [16, 128, 1024], [16, 1, 1]),  # v7_shape: no more than the shape
    (100, 0, 256 << 10, [4, 512, 1024], [4, 1, 1]),  # v8_shape
])
def test_min_max_variable_partitioner(max_partitions, axis, min_slice_size, shape,
                                      partitions):  # testMinMaxVariablePartitioner
    partitioner = min_max_variable_partitioner(
        max_partitions=max_partitions, axis=axis, min_slice_size=min_slice_size)
    assert partitioner(shape=tuple(shape), dtype=F32) == partitions
    if axis == 0:
        assert len(placed(partitioner, shape)) == partitions[0]


# --- PartitionedVariablesTestCase: the slice sizes of its save specs -------------------
def test_iota_slices():  # testIotaInitializer: [13, 5] in [3, 1] is "0,5", "5,4", "9,4"
    assert placed(fixed_size_partitioner(3), (13, 5)) == [(0, 5), (5, 9), (9, 13)]


def test_slice_size_one():  # testSliceSizeOne: [10, 43] in [10, 1]
    assert placed(fixed_size_partitioner(10), (10, 43)) == [(i, i + 1) for i in range(10)]


def test_degenerate():  # testDegenerate: [10, 43] in [1, 1]
    assert placed(fixed_size_partitioner(1), (10, 43)) == [(0, 10)]


@pytest.mark.parametrize("parts, ranges", [  # testRandomInitUnevenPartitions, along axis 1
    (1, [(0, 43)]),
    (2, [(0, 22), (22, 43)]),
    (3, [(0, 15), (15, 29), (29, 43)]),
    (4, [(0, 11), (11, 22), (22, 33), (33, 43)]),
    (5, [(0, 9), (9, 18), (18, 27), (27, 35), (35, 43)]),
])
def test_uneven_partitions(parts, ranges):
    assert placed(fixed_size_partitioner(parts, axis=1), (1, 43), F64) == ranges
    if parts > 1:
        with pytest.raises(ConfigurationError, match="cut along axis 1"):
            placed(fixed_size_partitioner(parts, axis=1), (20, 43), F64)
