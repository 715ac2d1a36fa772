"""HDF5 data sets sharded over workers, streamed through a shuffle buffer, with prefetch.

Worker ``i`` of ``W`` owns the contiguous sample range ``[i*N//W, (i+1)*N//W)`` of a split
and reads only that range, in chunk-aligned blocks through a buffer of a bounded number of
rows (:mod:`mpitf.data.stream`): a worker's memory is bounded by its buffer, not the file.
Each epoch's order is a pure function of ``(seed, epoch, shard, buffer)``, so a position
``(epoch, cursor)`` names the next batch exactly, and a job restarted from a checkpoint (with
the same buffer) sees the very batches it would have seen.
"""

import os

import numpy

from ..config import check_batch_size
from ..errors import ConfigurationError, DataError
from .batches import ShardBatches
from .stream import ShardReader, buffer_rows

__all__ = ["ShardedDataset", "check_file", "load_split"]


def _open(path, split):
    """Open ``path`` and return ``(file, x, y)`` h5py objects for ``split``, validated."""
    import h5py

    x_name, y_name = f"x_{split}", f"y_{split}"
    if not os.path.isfile(path):
        raise DataError(
            f"data file {path} not found (looking for arrays {x_name}, {y_name}); "
            "create it with `mpitf data` or mpitf.data.datasets.prepare_digits"
        )
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"cannot open data file {path} as HDF5 (looking for {x_name}): {exc}") \
            from None
    try:
        for name in (x_name, y_name):
            if name not in f or not isinstance(f[name], h5py.Dataset):
                raise DataError(
                    f"data file {path} has no array {name!r} (it has: {', '.join(sorted(f))})"
                )
        x, y = f[x_name], f[y_name]
        if x.ndim < 1 or y.ndim != 1:
            raise DataError(
                f"data file {path}: {y_name} must be 1-D and {x_name} at least 1-D, got "
                f"shapes {x.shape} and {y.shape}"
            )
        if x.shape[0] != y.shape[0]:
            raise DataError(
                f"data file {path}: {x_name} has {x.shape[0]} samples but {y_name} has "
                f"{y.shape[0]}"
            )
    except BaseException:
        f.close()
        raise
    return f, x, y


def _read(path, name, dset, start, stop):
    """Read rows ``[start, stop)`` of ``dset``, turning HDF5 read errors into DataError."""
    try:
        return dset[start:stop]
    except (OSError, RuntimeError) as exc:
        raise DataError(f"data file {path}: cannot read {name}[{start}:{stop}]: {exc}") from None


def check_file(path, splits=("train", "test"), num_classes=10, batch_size=None, num_shards=1):
    """Raise DataError (naming the file and the array) unless ``path`` is fit to train on.

    Every split must be there with labels of an integer type in ``[0, classes)`` (the
    file's ``num_classes`` attribute, else ``num_classes``): a label of -1 would index the
    last class and a float label would be truncated, silently. Every split's samples must
    have the train split's shape, and an ``image_shape`` attribute must hold one sample.
    With ``batch_size``, the smallest of ``num_shards`` shards of the first split must hold
    a batch. Labels are read in blocks; features only by their shape. A bad
    ``$MPITF_DATA_BUFFER_MIB`` is refused here too, before any worker reads.
    """
    buffer_rows(None, 1)
    shape = None
    for split in splits:
        f, x, y = _open(path, split)
        with f:
            classes = _attr(f, "num_classes") or num_classes
            if x.dtype.kind not in "biuf":
                raise DataError(f"data file {path}: x_{split} must hold numbers, got dtype "
                                f"{x.dtype}")
            if shape is None:
                shape = x.shape[1:]
                smallest = x.shape[0] // num_shards
                if batch_size is not None and smallest < batch_size:
                    raise DataError(
                        f"data file {path}: the smallest of {num_shards} shards (workers) of "
                        f"x_{split} holds {smallest} samples, fewer than batch_size="
                        f"{batch_size}; use a smaller --batch-size")
                image_shape = _attr(f, "image_shape")
                if image_shape is not None and np_prod(image_shape) != np_prod(shape):
                    raise DataError(
                        f"data file {path}: attribute image_shape {tuple(image_shape)} does "
                        f"not hold one sample of x_{split}, of shape {tuple(shape)}")
            elif x.shape[1:] != shape:
                raise DataError(
                    f"data file {path}: samples of x_{split} have shape {tuple(x.shape[1:])} "
                    f"but those of x_{splits[0]} {tuple(shape)}: every split needs the same "
                    "features")
            for lo in range(0, y.shape[0], _LABEL_BLOCK):  # in blocks: the file may be large
                _check_labels(path, f"y_{split}", _read(path, f"y_{split}", y, lo,
                                                        lo + _LABEL_BLOCK), classes, lo)
    return path


_LABEL_BLOCK = 1 << 20


def _check_labels(path, name, y, classes, first=0):
    if y.dtype.kind not in "iu":
        raise DataError(f"data file {path}: {name} must hold integer class labels, got dtype "
                        f"{y.dtype}; store them as integers in [0, {classes})")
    if y.size and (int(y.min()) < 0 or int(y.max()) >= classes):
        bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
        where = first + int(numpy.flatnonzero(y == bad)[0])
        raise DataError(f"data file {path}: {name}[{where}] = {bad} is outside the classes "
                        f"[0, {classes}) (num_classes={classes}); fix the labels or the file's "
                        "num_classes attribute")


def load_split(path, split):
    """Return the whole ``(x, y)`` of ``split`` ("train" or "test") as host arrays.

    ``x`` comes as one flat row per sample, as the models take it (see :class:`ShardedDataset`).
    """
    f, x, y = _open(path, split)
    with f:
        n = x.shape[0]
        x_all = _read(path, f"x_{split}", x, 0, n)
        return x_all.reshape(n, -1), _read(path, f"y_{split}", y, 0, n)


class ShardedDataset(ShardBatches):
    """One worker's shard of a split, served in shuffled batches forever.

    Args:
        path: HDF5 file in the mpitf layout (see :mod:`mpitf.data.datasets`).
        split: ``"train"`` or ``"test"`` (arrays ``x_<split>``, ``y_<split>``).
        shard_index: this worker's index in ``[0, num_shards)``.
        num_shards: number of workers sharing the split.
        batch_size: samples per batch.
        seed: shuffling seed; epochs and shards get distinct streams from it.
        prefetch: batches prepared ahead by a background thread (which also reads the
            file); 0 = synchronous.
        drop_remainder: end the epoch when fewer than ``batch_size`` samples are
            left (True), or serve them as a last short batch (False).
        buffer: the shuffle buffer, in samples: the most rows of the shard held at once
            (default: ``$MPITF_DATA_BUFFER_MIB`` MiB of rows, else 64 MiB). A buffer that
            holds the shard reads it once and shuffles it whole; a resumed job needs the
            buffer it was saved with to see the same batches.

    Attributes:
        num_samples: samples in this shard; ``start``, ``stop``: its range in the split.
        total_samples: samples in the whole split.
        batches_per_epoch: batches served per epoch.
        buffer: the shuffle buffer in samples; ``rows_held``, ``peak_rows_held``: the rows
            in it now and at most so far (never more than ``buffer``).
        num_classes, image_shape, name: the file's attributes (None where absent); a split
            stored as images (N, H, W) or (N, H, W, C) with no ``image_shape`` attribute
            takes its image shape from the array.

    Batches hold one flat row of ``x_dim`` features per sample, whatever the array's shape:
    the models take flat rows (the CNN reshapes them by its ``image_shape``).
    """

    def __init__(self, path, split="train", shard_index=0, num_shards=1, batch_size=32, seed=0,
                 prefetch=2, drop_remainder=True, buffer=None):
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ConfigurationError(
                f"shard_index must be in [0, num_shards), got {shard_index} of {num_shards}"
            )
        check_batch_size(batch_size)
        self.path, self.split = path, split
        self.shard_index, self.num_shards = int(shard_index), int(num_shards)
        self.batch_size, self.seed = int(batch_size), seed
        self.drop_remainder = bool(drop_remainder)
        f, x, y = _open(path, split)
        try:
            n = x.shape[0]
            if n < num_shards:
                raise DataError(
                    f"data file {path}: x_{split} has {n} samples, fewer than the "
                    f"{num_shards} shards (workers) that share it"
                )
            self.total_samples = n
            self.start = shard_index * n // num_shards
            self.stop = (shard_index + 1) * n // num_shards
            self.name = _attr(f, "name")
            self.num_classes = _attr(f, "num_classes")
            self.image_shape = _attr(f, "image_shape") or (
                tuple(int(d) for d in x.shape[1:]) if x.ndim in (3, 4) else None)
            self.x_dim = int(np_prod(x.shape[1:]))
            self.num_samples = self.stop - self.start
            if self.drop_remainder and self.num_samples < self.batch_size:
                raise ConfigurationError(
                    f"data file {path}: shard {shard_index} of {num_shards} holds "
                    f"{self.num_samples} samples of x_{split}, fewer than batch_size="
                    f"{self.batch_size}; use a smaller batch or drop_remainder=False"
                )
            reader = ShardReader(
                path, [(f"x_{split}", x), (f"y_{split}", y)], self.start, self.stop,
                self.batch_size, seed, self.shard_index, buffer, self.drop_remainder,
                prepare=lambda arrays, _: [arrays[0].reshape(len(arrays[0]), -1), arrays[1]])
            super().__init__(reader, prefetch, f)
        except BaseException:
            f.close()
            raise
        if self.drop_remainder:
            self.batches_per_epoch = self.num_samples // self.batch_size
        else:
            self.batches_per_epoch = -(-self.num_samples // self.batch_size)

    def __repr__(self):
        return (f"ShardedDataset({self.path!r}, split={self.split!r}, shard {self.shard_index} "
                f"of {self.num_shards}: samples [{self.start}, {self.stop}), "
                f"batch_size={self.batch_size}, buffer={self.buffer}, position={self.state()})")


def np_prod(shape):
    """Return the product of a shape (1 for a scalar shape)."""
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _attr(f, key):
    """Return attribute ``key`` of ``f`` as a plain Python value, or None."""
    if key not in f.attrs:
        return None
    value = f.attrs[key]
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, numpy.ndarray):
        return tuple(int(v) for v in value)
    if isinstance(value, numpy.generic):
        return value.item()
    return value
