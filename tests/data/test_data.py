"""Sharded HDF5 data: coverage, shuffling, exact resume, error messages, data set files."""

import gzip
import os

import h5py
import numpy as np
import pytest

from mpitf.data.datasets import (
    convert_mnist_idx,
    default_data_path,
    ensure_digits,
    prepare_digits,
    write_dataset,
)
from mpitf.data.sharded import ShardedDataset, load_split
from mpitf.errors import ConfigurationError, DataError


def make_file(path, n_train=23, n_test=7, dim=3):
    """Write a file whose y is the sample index and x rows are index-filled."""
    xtr = np.repeat(np.arange(n_train, dtype=np.float32)[:, None], dim, axis=1)
    xte = np.repeat(np.arange(n_test, dtype=np.float32)[:, None], dim, axis=1)
    write_dataset(str(path), xtr, np.arange(n_train), xte, np.arange(n_test),
                  name="toy", num_classes=n_train, image_shape=(dim, 1, 1))
    return str(path)


@pytest.fixture
def toy(tmp_path):
    return make_file(tmp_path / "toy.h5")


def epoch_ids(ds):
    """Sample ids of one whole epoch of ds, asserting the epoch ends where expected."""
    start = ds.state()["epoch"]
    ids = []
    for _ in range(ds.batches_per_epoch):
        x, y = ds.next_batch()
        np.testing.assert_array_equal(x[:, 0], y)  # rows stay paired with labels
        ids.extend(y.tolist())
    assert ds.state() == {"epoch": start + 1, "cursor": 0}
    return ids


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_shards_are_disjoint_and_cover_the_epoch(toy, workers, prefetch):
    seen = []
    for i in range(workers):
        with ShardedDataset(toy, shard_index=i, num_shards=workers, batch_size=1,
                            prefetch=prefetch) as ds:
            assert (ds.start, ds.stop) == (i * 23 // workers, (i + 1) * 23 // workers)
            ids = epoch_ids(ds)
            assert sorted(ids) == list(range(ds.start, ds.stop))
            seen.extend(ids)
    assert sorted(seen) == list(range(23))


def test_drop_remainder(toy):
    with ShardedDataset(toy, shard_index=1, num_shards=2, batch_size=4, prefetch=0) as ds:
        assert ds.num_samples == 12 and ds.batches_per_epoch == 3
        ids = epoch_ids(ds)
        assert len(set(ids)) == 12
    with ShardedDataset(toy, batch_size=10, prefetch=0, drop_remainder=False) as ds:
        sizes = [len(ds.next_batch()[1]) for _ in range(3)]
        assert sizes == [10, 10, 3] and ds.state() == {"epoch": 1, "cursor": 0}


def test_same_seed_same_order_other_epoch_other_order(toy):
    a = ShardedDataset(toy, batch_size=23, seed=5, prefetch=0)
    b = ShardedDataset(toy, batch_size=23, seed=5, prefetch=3)
    c = ShardedDataset(toy, batch_size=23, seed=6, prefetch=0)
    e0a, e1a = a.next_batch()[1], a.next_batch()[1]
    e0b, e1b = b.next_batch()[1], b.next_batch()[1]
    np.testing.assert_array_equal(e0a, e0b)
    np.testing.assert_array_equal(e1a, e1b)
    assert not np.array_equal(e0a, e1a)
    assert not np.array_equal(e0a, c.next_batch()[1])
    rng = np.random.default_rng((5, 1, 0))
    np.testing.assert_array_equal(e1a, rng.permutation(23))
    for ds in (a, b, c):
        ds.close()


@pytest.mark.parametrize("prefetch", [0, 1, 4])
def test_state_and_restore_give_the_same_next_batches(toy, prefetch):
    with ShardedDataset(toy, shard_index=0, num_shards=2, batch_size=3, seed=1,
                        prefetch=prefetch) as ds:
        for _ in range(5):  # into the second epoch (3 batches per epoch)
            ds.next_batch()
        saved = ds.state()
        assert saved == {"epoch": 1, "cursor": 6}
        expected = [ds.next_batch()[1] for _ in range(7)]
        # A fresh dataset (a restarted job) and the same one both resume exactly.
        with ShardedDataset(toy, shard_index=0, num_shards=2, batch_size=3, seed=1,
                            prefetch=prefetch) as fresh:
            fresh.next_batch()  # let prefetch run ahead of the position
            fresh.restore(saved)
            assert fresh.state() == saved
            for want in expected:
                np.testing.assert_array_equal(fresh.next_batch()[1], want)
        ds.restore(saved)
        for want in expected:
            np.testing.assert_array_equal(ds.next_batch()[1], want)


def test_iter_and_restore_validation(toy):
    ds = ShardedDataset(toy, batch_size=5, prefetch=0)
    it = iter(ds)
    assert [len(next(it)[1]) for _ in range(10)] == [5] * 10
    for bad in ({"epoch": 0}, {"epoch": 0, "cursor": 99}, None):
        with pytest.raises(ConfigurationError):
            ds.restore(bad)
    ds.close()
    with pytest.raises(ConfigurationError, match="closed"):
        ds.next_batch()


def test_prefetch_error_reraises_in_next_batch(toy):
    ds = ShardedDataset(toy, batch_size=2, prefetch=2)

    def broken(*args):
        raise RuntimeError("disk on fire")

    ds._batch_at = broken
    for _ in range(2):
        with pytest.raises(RuntimeError, match="disk on fire"):
            ds.next_batch()
    ds.close()


def test_attributes(toy):
    ds = ShardedDataset(toy, split="test", batch_size=2)
    assert (ds.name, ds.num_classes, ds.image_shape, ds.total_samples) == (
        "toy", 23, (3, 1, 1), 7)
    ds.close()


def test_argument_errors(toy):
    for kwargs in ({"shard_index": 2, "num_shards": 2}, {"num_shards": 0}, {"batch_size": 0},
                   {"prefetch": -1}):
        with pytest.raises(ConfigurationError):
            ShardedDataset(toy, **kwargs)
    with pytest.raises(ConfigurationError, match="fewer than batch_size"):
        ShardedDataset(toy, num_shards=3, batch_size=8)


def test_missing_file_names_file_and_array(tmp_path):
    path = str(tmp_path / "nope.h5")
    for call in (lambda: ShardedDataset(path), lambda: load_split(path, "test")):
        with pytest.raises(DataError) as err:
            call()
        assert path in str(err.value) and "x_" in str(err.value)


def test_not_hdf5_names_file(tmp_path):
    path = tmp_path / "junk.h5"
    path.write_bytes(b"not an hdf5 file")
    with pytest.raises(DataError, match="junk.h5.*x_train"):
        ShardedDataset(str(path))


def test_missing_array_names_file_and_array(tmp_path):
    path = str(tmp_path / "partial.h5")
    with h5py.File(path, "w") as f:
        f["x_train"] = np.zeros((4, 2), np.float32)
    with pytest.raises(DataError) as err:
        ShardedDataset(path)
    assert path in str(err.value) and "y_train" in str(err.value)
    with pytest.raises(DataError, match="x_valid"):
        load_split(path, "valid")


def test_length_mismatch_names_both_arrays_and_lengths(tmp_path):
    path = str(tmp_path / "mismatch.h5")
    with h5py.File(path, "w") as f:
        f["x_train"] = np.zeros((10, 2), np.float32)
        f["y_train"] = np.zeros(9, np.int64)
    for call in (lambda: ShardedDataset(path), lambda: load_split(path, "train")):
        with pytest.raises(DataError) as err:
            call()
        msg = str(err.value)
        assert all(s in msg for s in (path, "x_train", "y_train", "10", "9"))


def test_fewer_samples_than_shards(tmp_path):
    path = make_file(tmp_path / "small.h5", n_train=2)
    with pytest.raises(DataError) as err:
        ShardedDataset(path, shard_index=0, num_shards=3, batch_size=1)
    msg = str(err.value)
    assert all(s in msg for s in (path, "x_train", "2", "3"))


def test_load_split(toy):
    x, y = load_split(toy, "test")
    assert x.shape == (7, 3) and x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(y, np.arange(7))


def test_prepare_digits_atomic(tmp_path):
    path = str(tmp_path / "sub" / "digits.h5")
    assert prepare_digits(path) == path
    assert os.listdir(tmp_path / "sub") == ["digits.h5"]  # no .tmp left behind
    (xtr, ytr), (xte, yte) = load_split(path, "train"), load_split(path, "test")
    assert len(xtr) + len(xte) == 1797 and len(xte) == round(1797 * 0.2)
    assert xtr.shape[1] == 64 and xtr.dtype == np.float32 and ytr.dtype == np.int64
    assert 0.0 <= xtr.min() and xtr.max() <= 1.0 and xtr.max() == 1.0
    assert set(np.concatenate([ytr, yte]).tolist()) == set(range(10))
    with h5py.File(path) as f:
        assert f.attrs["num_classes"] == 10 and tuple(f.attrs["image_shape"]) == (8, 8, 1)
    again = str(tmp_path / "again.h5")
    prepare_digits(again)
    np.testing.assert_array_equal(load_split(again, "test")[1], yte)  # fixed seed


def test_prepare_digits_without_sklearn(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_sklearn(name, *args, **kwargs):
        if name.startswith("sklearn"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    with pytest.raises(DataError, match="pip install scikit-learn"):
        prepare_digits(str(tmp_path / "d.h5"))


def test_default_path_and_ensure_digits(tmp_path, monkeypatch):
    monkeypatch.setenv("MPITF_DATA_DIR", str(tmp_path))
    assert default_data_path() == os.path.join(str(tmp_path), "digits.h5")
    monkeypatch.delenv("MPITF_DATA_DIR")
    assert default_data_path() == os.path.expanduser("~/.cache/mpitf/digits.h5")
    monkeypatch.setenv("MPITF_DATA_DIR", str(tmp_path))
    path = ensure_digits()
    assert path == str(tmp_path / "digits.h5") and os.path.exists(path)
    mtime = os.stat(path).st_mtime_ns
    assert ensure_digits(path) == path and os.stat(path).st_mtime_ns == mtime


def write_idx(path, arr, magic_type=0x08, compress=False):
    header = bytes([0, 0, magic_type, arr.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def make_idx_dir(d, rng, n_train=6, n_test=4):
    images = {"train": rng.integers(0, 256, (n_train, 3, 2)),
              "t10k": rng.integers(0, 256, (n_test, 3, 2))}
    labels = {"train": rng.integers(0, 10, n_train), "t10k": rng.integers(0, 10, n_test)}
    write_idx(d / "train-images-idx3-ubyte", images["train"])
    write_idx(d / "train-labels-idx1-ubyte", labels["train"], compress=True)
    write_idx(d / "t10k-images-idx3-ubyte", images["t10k"], compress=True)
    write_idx(d / "t10k-labels-idx1-ubyte", labels["t10k"])
    return images, labels


def test_convert_mnist_idx(tmp_path):
    images, labels = make_idx_dir(tmp_path, np.random.default_rng(0))
    out = str(tmp_path / "mnist.h5")
    assert convert_mnist_idx(str(tmp_path), out) == out
    x, y = load_split(out, "train")
    assert x.shape == (6, 6) and x.dtype == np.float32
    np.testing.assert_allclose(x, images["train"].reshape(6, 6) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y, labels["train"])
    np.testing.assert_array_equal(load_split(out, "test")[1], labels["t10k"])
    with h5py.File(out) as f:
        assert f.attrs["name"] == "mnist" and tuple(f.attrs["image_shape"]) == (3, 2, 1)
    assert not os.path.exists(out + ".tmp")


def test_convert_mnist_idx_errors(tmp_path):
    make_idx_dir(tmp_path, np.random.default_rng(0))
    os.remove(tmp_path / "t10k-labels-idx1-ubyte")
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.*y_test"):
        convert_mnist_idx(str(tmp_path), str(tmp_path / "out.h5"))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(4), magic_type=0x09)
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.*magic"):
        convert_mnist_idx(str(tmp_path), str(tmp_path / "out.h5"))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(3))
    with pytest.raises(DataError, match="4 images.*3 labels"):
        convert_mnist_idx(str(tmp_path), str(tmp_path / "out.h5"))
    assert not os.path.exists(tmp_path / "out.h5")
