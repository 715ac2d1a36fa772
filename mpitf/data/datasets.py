"""Data sets that need no network, written in mpitf's one HDF5 layout.

The layout: arrays ``x_train`` (N, D) float32 in [0, 1], ``y_train`` (N,) int64,
``x_test``, ``y_test``, and attributes ``name``, ``num_classes`` and
``image_shape`` (H, W, C) that tells how a row of ``x`` folds into an NHWC image.
Arrays are chunked by whole rows for streaming reads (:mod:`mpitf.data.chunks`).
"""

import gzip
import os

import numpy

from ..errors import ConfigurationError, DataError
from .chunks import check_compression, create_rows, split_rows

__all__ = [
    "convert_mnist_idx",
    "default_data_path",
    "ensure_digits",
    "prepare_digits",
    "write_dataset",
]

_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_IDX_UBYTE = 0x08


def _fsync_dir(path):
    """Flush the directory entry of ``path`` so a rename survives a crash."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:  # some file systems do not open directories; the rename still happened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # fsync of a directory is unsupported on some file systems; nothing to recover
    finally:
        os.close(fd)


def write_dataset(out_path, x_train, y_train, x_test, y_test, *, name, num_classes,
                  image_shape, compression=None):
    """Write a data set in the mpitf layout, atomically.

    The file is written to ``out_path + ".tmp"``, flushed, fsynced and renamed
    over ``out_path``, so a reader never sees a half-written file. Arrays are chunked by
    whole rows; ``compression`` ("gzip" or "lzf") is off by default.

    Returns:
        ``out_path``.
    """
    import h5py

    check_compression(compression)
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if len(x) != len(y):
            raise DataError(f"{out_path}: x_{split} has {len(x)} rows but y_{split} has {len(y)}")
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    tmp = out_path + ".tmp"
    try:
        with h5py.File(tmp, "w") as f:
            for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
                x, y = numpy.asarray(x), numpy.asarray(y, dtype=numpy.int64)
                rows = split_rows((x, y))
                create_rows(f, f"x_{split}", x.shape, x.dtype, rows, compression, x)
                create_rows(f, f"y_{split}", y.shape, y.dtype, rows, compression, y)
            f.attrs["name"] = name
            f.attrs["num_classes"] = int(num_classes)
            f.attrs["image_shape"] = numpy.asarray(image_shape, dtype=numpy.int64)
            f.flush()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(out_path)
    return out_path


def prepare_digits(out_path, test_fraction=0.2, seed=0, compression=None):
    """Write scikit-learn's bundled 8x8 digits (1797 images, 10 classes) to ``out_path``.

    The data ship inside scikit-learn, so nothing is downloaded. Samples are
    shuffled with ``seed``, split with ``test_fraction`` of them held out for
    testing, and pixel values 0..16 scaled to [0, 1].

    Returns:
        ``out_path``.
    """
    if not 0 < test_fraction < 1:
        raise ConfigurationError(f"test_fraction must be in (0, 1), got {test_fraction}")
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError(
            f"cannot prepare {out_path}: the digits data come with scikit-learn, which is "
            "not installed; run `pip install scikit-learn` (or `pip install mpitf[data]`)"
        ) from None
    digits = load_digits()
    x = (digits.data / 16.0).astype(numpy.float32)
    y = digits.target.astype(numpy.int64)
    order = numpy.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = max(1, int(round(len(x) * test_fraction)))
    return write_dataset(out_path, x[n_test:], y[n_test:], x[:n_test], y[:n_test],
                         name="digits", num_classes=10, image_shape=(8, 8, 1),
                         compression=compression)


def _find_idx(idx_dir, base, array):
    """Return the path of IDX file ``base`` in ``idx_dir``, plain or ``.gz``."""
    candidates = [os.path.join(idx_dir, base), os.path.join(idx_dir, base + ".gz")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise DataError(
        f"MNIST IDX file {candidates[0]} ({array}) not found, nor {candidates[1]}"
    )


def _read_idx(path, array, ndim):
    """Read one IDX file of unsigned bytes with ``ndim`` dimensions."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise DataError(f"cannot read MNIST IDX file {path} ({array}): {exc}") from None
    magic = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    expected = (_IDX_UBYTE << 8) | ndim
    if magic != expected:
        found = "a truncated header" if magic is None else f"0x{magic:08x}"
        raise DataError(
            f"{path} ({array}): bad IDX magic number {found}, expected 0x{expected:08x} "
            f"(unsigned bytes, {ndim} dimensions); is this the right file?"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path} ({array}): IDX header truncated")
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    count = int(numpy.prod(dims))
    if len(raw) - header != count:
        raise DataError(
            f"{path} ({array}): IDX header says {dims} = {count} bytes, "
            f"file holds {len(raw) - header}"
        )
    return numpy.frombuffer(raw, dtype=numpy.uint8, offset=header).reshape(dims)


def convert_mnist_idx(idx_dir, out_path, compression=None):
    """Convert the four MNIST IDX files in ``idx_dir`` to the mpitf layout at ``out_path``.

    Reads ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (each may end in
    ``.gz``); images are flattened to rows of H*W and scaled to [0, 1].

    Returns:
        ``out_path``.
    """
    arrays, shapes = {}, {}
    for array, base in _IDX_FILES.items():
        path = _find_idx(idx_dir, base, array)
        data = _read_idx(path, array, 3 if array.startswith("x") else 1)
        shapes[array] = data.shape
        if array.startswith("x"):
            data = (data.reshape(len(data), -1) / 255.0).astype(numpy.float32)
        arrays[array] = (path, data)
    for split in ("train", "test"):
        (xpath, x), (ypath, y) = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if len(x) != len(y):
            raise DataError(
                f"{xpath} (x_{split}) holds {len(x)} images but {ypath} (y_{split}) holds "
                f"{len(y)} labels"
            )
    if shapes["x_train"][1:] != shapes["x_test"][1:]:
        raise DataError(f"train images {shapes['x_train']} and test images {shapes['x_test']} "
                        f"in {idx_dir} differ in size")
    rows, cols = shapes["x_train"][1:]
    labels = numpy.concatenate([arrays["y_train"][1], arrays["y_test"][1]])
    num_classes = max(10, int(labels.max()) + 1) if len(labels) else 10
    return write_dataset(
        out_path, arrays["x_train"][1], arrays["y_train"][1], arrays["x_test"][1],
        arrays["y_test"][1], name="mnist", num_classes=num_classes, image_shape=(rows, cols, 1),
        compression=compression,
    )


def default_data_path():
    """Return where the digits file lives: ``$MPITF_DATA_DIR/digits.h5`` or ``~/.cache``."""
    root = os.environ.get("MPITF_DATA_DIR")
    if root:
        return os.path.join(os.path.expanduser(root), "digits.h5")
    return os.path.join(os.path.expanduser("~"), ".cache", "mpitf", "digits.h5")


def ensure_digits(path=None):
    """Return the digits file path, preparing the file first if it does not exist.

    Call it on one rank only, then barrier: writers of one path share its
    ``.tmp`` name. Readers never see a partial file (the write is atomic).

    Args:
        path: where the file is (None: :func:`~mpitf.data.datasets.default_data_path`).

    Returns:
        The path of the file, which exists now.
    """
    path = path or default_data_path()
    if not os.path.exists(path):
        prepare_digits(path)
    return path
