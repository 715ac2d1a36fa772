"""Which ps task owns which variable or slice: pure and deterministic, no messages.

Every worker computes the same map from the same variable list, so nobody has to ask.
Strategies follow TensorFlow's ``replica_device_setter``: round-robin in creation order is
the default; :class:`GreedyLoadBalancingStrategy` balances bytes; a partitioner (TensorFlow's
three, with its arithmetic) cuts a large variable into contiguous row blocks that are placed
like variables of their own.
"""

from dataclasses import dataclass

import numpy as np

from .cluster import ClusterSpec
from .errors import ConfigurationError


@dataclass(frozen=True)
class VariableSlice:
    """One contiguous piece of a variable owned by one ps.

    ``start``/``stop`` are offsets into the variable's flattened (row-major) elements;
    ``offset`` is where the piece lives in its ps's shard, in elements.
    """

    name: str
    shape: tuple
    dtype: str
    ps_task: int
    start: int
    stop: int
    offset: int
    part: int = 0
    num_parts: int = 1

    @property
    def size(self):
        """Return the number of elements in this slice."""
        return self.stop - self.start

    @property
    def nbytes(self):
        """Return the bytes in this slice."""
        return self.size * np.dtype(self.dtype).itemsize


class RoundRobinStrategy:
    """Place variables on ps tasks in turn, in creation order (TensorFlow's default)."""

    name = "round_robin"

    def assign(self, sizes, num_ps):
        """Return the ps task of each item given its size in bytes."""
        return [i % num_ps for i in range(len(sizes))]


class GreedyLoadBalancingStrategy:
    """Place each variable on the ps with the fewest bytes so far, largest variables first.

    TensorFlow's strategy walks variables in creation order, so its result depends on that
    order; placing the largest first gives a better balance and does not.
    """

    name = "greedy"

    def assign(self, sizes, num_ps):
        """Return the ps task of each item given its size in bytes."""
        load = [0] * num_ps
        owner = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            ps = min(range(num_ps), key=lambda p: (load[p], p))
            owner[i] = ps
            load[ps] += sizes[i]
        return owner


def _element_size(dtype, bytes_per_string_element):
    dtype = np.dtype(dtype)
    return bytes_per_string_element if dtype.kind in "SUO" else dtype.itemsize


def _check_axis(axis, shape):
    if axis >= len(shape):
        raise ConfigurationError(
            f"cannot partition a variable along axis {axis} when its shape is only {shape}")


class MinMaxVariablePartitioner:
    """Cut a variable along ``axis`` into at most ``max_partitions`` slices of enough bytes.

    TensorFlow's arithmetic: ceil(bytes / min_slice_size) slices, capped. Called as
    TensorFlow calls a partitioner, ``partitioner(shape=..., dtype=...)``, it returns
    the number of slices per axis. :func:`min_max_variable_partitioner` makes one.
    """

    def __init__(self, max_partitions=1, min_slice_size=256 << 10, axis=0,
                 bytes_per_string_element=16):
        if max_partitions < 1:
            raise ConfigurationError("max_partitions must be at least 1")
        if min_slice_size < 1:
            raise ConfigurationError("min_slice_size must be positive")
        self.max_partitions = int(max_partitions)
        self.min_slice_size = int(min_slice_size)
        self.axis = int(axis)
        self.bytes_per_string_element = int(bytes_per_string_element)

    def __call__(self, shape, dtype):
        """Return the slices per axis of a variable of this shape and dtype."""
        _check_axis(self.axis, shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * _element_size(
            dtype, self.bytes_per_string_element)
        parts = [1] * len(shape)
        parts[self.axis] = max(1, min(shape[self.axis], self.max_partitions,
                                      -(-nbytes // self.min_slice_size)))
        return parts


def min_max_variable_partitioner(max_partitions=1, axis=0, min_slice_size=256 << 10,
                                 bytes_per_string_element=16):
    """Return a partitioner as TensorFlow's function of that name does (same arguments).

    Args:
        max_partitions: the most slices a variable is cut into.
        axis: the axis cut along.
        min_slice_size: the least bytes of a slice: a variable gets
            ``ceil(bytes / min_slice_size)`` slices, at most ``max_partitions`` and the
            axis length.
        bytes_per_string_element: the size counted for one element of a string variable.
    """
    return MinMaxVariablePartitioner(max_partitions, min_slice_size, axis,
                                     bytes_per_string_element)


def fixed_size_partitioner(num_shards, axis=0):
    """Return TensorFlow's partitioner of that name: ``num_shards`` slices along ``axis``.

    Fewer when the axis is shorter.

    Args:
        num_shards: the number of slices (an integer >= 1).
        axis: the axis cut along.

    Raises:
        ConfigurationError: ``num_shards`` is not an integer >= 1.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigurationError(f"bad num_shards={num_shards!r}: expecting an integer >= 1")

    def partitioner(shape, **unused):
        _check_axis(axis, shape)
        parts = [1] * len(shape)
        parts[axis] = min(num_shards, shape[axis])
        return parts
    return partitioner


def variable_axis_size_partitioner(max_shard_bytes, axis=0, bytes_per_string_element=16,
                                   max_shards=None):
    """Return TensorFlow's partitioner of that name: slices under ``max_shard_bytes``.

    Slices along ``axis`` hold at least one row each, and there are at most ``max_shards``.

    Args:
        max_shard_bytes: the most bytes of a slice.
        axis: the axis cut along.
        bytes_per_string_element: the size counted for one element of a string variable.
        max_shards: the most slices (None: no limit).

    Raises:
        ConfigurationError: a size or count that is not positive.
    """
    if max_shard_bytes < 1 or bytes_per_string_element < 1:
        raise ConfigurationError(
            "max_shard_bytes and bytes_per_string_element must be positive; got"
            f" {max_shard_bytes} and {bytes_per_string_element}")
    if max_shards is not None and max_shards < 1:
        raise ConfigurationError(f"max_shards must be positive; got {max_shards}")

    def partitioner(shape, dtype):
        _check_axis(axis, shape)
        row = int(np.prod(shape, dtype=np.int64)) // shape[axis] if shape[axis] else 0
        row_bytes = row * _element_size(dtype, bytes_per_string_element)
        rows_per_shard = max(1, max_shard_bytes // max(row_bytes, 1))
        parts = [1] * len(shape)
        parts[axis] = -(-shape[axis] // rows_per_shard)
        if max_shards:
            parts[axis] = min(max_shards, parts[axis])
        return parts
    return partitioner


def _split_rows(name, shape, dtype, partitioner):
    """Return the boundaries [0, ..., n] along the cut axis, in flat elements' rows.

    The ps holds each slice as one contiguous range of the variable's row-major
    elements, which a cut along an axis gives only when every axis before it has
    length 1: axis 0 always; other axes are refused. Slice sizes follow TensorFlow's:
    the first ``n % parts`` slices get one row more.
    """
    parts = [int(p) for p in partitioner(shape=shape, dtype=np.dtype(dtype))]
    cut = [a for a, p in enumerate(parts) if p != 1]
    if len(parts) != len(shape) or any(p < 1 for p in parts) or len(cut) > 1:
        raise ConfigurationError(
            f"the partitioner gave {parts} for variable {name!r} of shape {shape}: expecting"
            " one positive count per axis, more than 1 on one axis at most")
    if not cut:
        return 0, [0, shape[0]]
    axis, n = cut[0], parts[cut[0]]
    if any(d != 1 for d in shape[:axis]):
        raise ConfigurationError(
            f"variable {name!r} of shape {shape} is cut along axis {axis}, which mpitf cannot"
            " place: a ps holds contiguous row-major ranges, so cut along axis 0 (or an"
            " axis after only length-1 axes)")
    rows, extra = divmod(shape[axis], n)
    sizes = [rows + (k < extra) for k in range(n)]
    return axis, [sum(sizes[:k]) for k in range(n + 1)]


def _strategy(value):
    if value is None or value == "round_robin":
        return RoundRobinStrategy()
    if value == "greedy":
        return GreedyLoadBalancingStrategy()
    if hasattr(value, "assign"):
        return value
    raise ConfigurationError(f"unknown ps_strategy {value!r}: use 'round_robin' or 'greedy'")


class Placement:
    """The map from variables to ps tasks and offsets inside each ps's shard."""

    def __init__(self, variables, num_ps, strategy=None, partitioner=None):
        variables = [(str(n), tuple(int(d) for d in s), np.dtype(t).str) for n, s, t in variables]
        names = [v[0] for v in variables]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ConfigurationError(f"variable name {dup!r} is used twice")
        dtypes = {t for _, _, t in variables}
        if len(dtypes) > 1:
            first = variables[0]
            odd = next(v for v in variables if v[2] != first[2])
            raise ConfigurationError(
                f"variable {odd[0]!r} has dtype {np.dtype(odd[2]).name} but {first[0]!r} has "
                f"{np.dtype(first[2]).name}: all trainable variables must share one dtype")
        self.variables = variables
        self.num_ps = max(1, int(num_ps))
        self.dtype = np.dtype(variables[0][2]) if variables else np.dtype(np.float32)
        self.strategy = _strategy(strategy)
        # Cut into pieces, then let the strategy place every piece.
        pieces = []
        for name, shape, dtype in variables:
            size = int(np.prod(shape, dtype=np.int64))
            whole = (0, [0, shape[0] if shape else 1])
            axis, splits = (_split_rows(name, shape, dtype, partitioner)
                            if partitioner and shape and size else whole)
            row = size // shape[axis] if shape and shape[axis] else size
            for k in range(len(splits) - 1):
                start = splits[k] * row if shape else 0
                stop = splits[k + 1] * row if shape else size
                pieces.append((name, shape, dtype, start, stop, k, len(splits) - 1))
        owners = self.strategy.assign(
            [(p[4] - p[3]) * self.dtype.itemsize for p in pieces], self.num_ps)
        fill = [0] * self.num_ps
        self.slices = []
        for (name, shape, dtype, start, stop, k, parts), ps in zip(pieces, owners):
            self.slices.append(VariableSlice(name, shape, dtype, ps, start, stop, fill[ps],
                                             k, parts))
            fill[ps] += stop - start
        self.shard_sizes = fill

    def owner(self, name):
        """Return the slices of variable ``name``, in order (one unless partitioned)."""
        found = [s for s in self.slices if s.name == name]
        if not found:
            raise KeyError(f"no variable named {name!r}")
        return found

    def slices_for_ps(self, ps_task):
        """Return the slices ps task ``ps_task`` owns, in shard order."""
        return [s for s in self.slices if s.ps_task == ps_task]

    def bytes_per_ps(self):
        """Return the bytes each ps holds."""
        return [n * self.dtype.itemsize for n in self.shard_sizes]

    def describe(self):
        """Return the map as a table: variable, shape, bytes, ps task, slice."""
        lines = [f"{'variable':<32} {'shape':<16} {'bytes':>12}  {'device':<24} slice"]
        for s in self.slices:
            piece = f"{s.part}/{s.num_parts} [{s.start}:{s.stop}]" if s.num_parts > 1 else "-"
            lines.append(f"{s.name:<32} {str(s.shape):<16} {s.nbytes:>12}  "
                         f"{f'/job:ps/task:{s.ps_task}':<24} {piece}")
        for p, b in enumerate(self.bytes_per_ps()):
            lines.append(f"/job:ps/task:{p} holds {b} bytes")
        return "\n".join(lines)


class DeviceSetter:
    """What :func:`replica_device_setter` returns: place a model's variables on ps tasks."""

    def __init__(self, num_ps, strategy=None, partitioner=None):
        self.num_ps = num_ps
        self.strategy = _strategy(strategy)
        self.partitioner = partitioner

    def place(self, variables):
        """Return the :class:`Placement` of ``[(name, shape, dtype), ...]`` in creation order."""
        return Placement(variables, self.num_ps, self.strategy, self.partitioner)


def replica_device_setter(cluster=None, ps_tasks=None, ps_strategy=None, partitioner=None):
    """Return a :class:`DeviceSetter` for the ps tasks of ``cluster`` (or ``ps_tasks`` of them).

    Args:
        cluster: a ClusterSpec or a dict that makes one; as in TensorFlow, its ``ps`` job
            gives the ps count (none without a ps job) and ``ps_tasks`` is then unused.
        ps_tasks: the ps count, when no cluster is given.
        ps_strategy: ``"round_robin"`` (default), ``"greedy"``, or an object with ``assign``.
        partitioner: a partitioner for large variables (``min_max_variable_partitioner``,
            ``fixed_size_partitioner``, ``variable_axis_size_partitioner``, or any callable
            ``(shape=, dtype=) -> slices per axis`` as in TensorFlow), or None.
    """
    if cluster is not None:
        spec = ClusterSpec(cluster)
        ps_tasks = spec.num_tasks("ps") if "ps" in spec.jobs else 0
    elif ps_tasks is None:
        raise ConfigurationError(
            "give a cluster or ps_tasks: replica_device_setter(cluster={'ps': [...], ...})")
    if isinstance(ps_tasks, bool) or not isinstance(ps_tasks, int) or ps_tasks < 0:
        raise ConfigurationError(f"bad ps_tasks={ps_tasks!r}: expecting an integer >= 0")
    return DeviceSetter(ps_tasks, ps_strategy, partitioner)
