"""Streaming shards: the batch order, exact resume and the bounded buffer, on real HDF5 files."""

import h5py
import numpy as np
import pytest

from mpitf.data.chunks import chunk_rows
from mpitf.data.datasets import write_dataset
from mpitf.data.sharded import ShardedDataset
from mpitf.data.stream import BUFFER_ENV, buffer_rows, cut_blocks, epoch_order
from mpitf.errors import ConfigurationError

N, CHUNK = 103, 8


@pytest.fixture
def chunked(tmp_path):
    """A file of N rows chunked by CHUNK rows; x row i is (i, i), y[i] = i."""
    path = str(tmp_path / "chunked.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x_train", data=np.repeat(np.arange(N, dtype=np.float32)[:, None], 2,
                                                   axis=1), chunks=(CHUNK, 2))
        f.create_dataset("y_train", data=np.arange(N), chunks=(CHUNK,))
    return path


def served(ds, batches):
    """Labels of ``batches`` batches, checking rows stay paired and the buffer bounded."""
    out = []
    for _ in range(batches):
        x, y = ds.next_batch()
        np.testing.assert_array_equal(x[:, 0], y)
        assert ds.rows_held <= ds.buffer
        out.append(y)
    return out


def test_blocks_follow_the_chunk_grid():
    np.testing.assert_array_equal(cut_blocks(5, 30, 8), [[5, 8], [8, 16], [16, 24], [24, 30]])
    np.testing.assert_array_equal(cut_blocks(8, 16, 8), [[8, 16]])


@pytest.mark.parametrize("buffer", [1, 5, 13, 40, 51, 1000])
@pytest.mark.parametrize("prefetch", [0, 3])
def test_streamed_batches_are_the_in_memory_order(chunked, buffer, prefetch):
    """Streaming serves x[order] for the order the numbers define, whatever the buffer."""
    shard, start, stop = 1, N // 2, N  # rows [51, 103): blocks cut at 56, 64, ...
    with ShardedDataset(chunked, shard_index=1, num_shards=2, batch_size=4, seed=3,
                        prefetch=prefetch, buffer=buffer) as ds:
        assert ds.batches_per_epoch == 13 and ds.buffer == buffer
        got = served(ds, 2 * ds.batches_per_epoch)
        assert ds.peak_rows_held <= buffer
        if buffer < stop - start:
            assert ds.peak_rows_held < stop - start  # never the whole shard
    for epoch in range(2):
        order = epoch_order(start, stop, CHUNK, 3, epoch, shard, buffer)
        assert sorted(order) == list(range(start, stop))  # every row once an epoch
        np.testing.assert_array_equal(np.concatenate(got[13 * epoch:13 * (epoch + 1)]),
                                      order[:52])
    if buffer >= stop - start:  # the whole shard in the buffer: the plain permutation
        rng = np.random.default_rng((3, 1, shard))
        np.testing.assert_array_equal(np.concatenate(got[13:]), start + rng.permutation(52))
        assert ds.rows_read == stop - start  # read once, whatever the epochs
    else:
        ahead = 1 if prefetch else 0  # the prefetch thread may have read into the next epoch
        assert 2 * (stop - start - 4) <= ds.rows_read <= (2 + ahead) * (stop - start)


def test_a_small_buffer_still_mixes_the_shard(chunked):
    with ShardedDataset(chunked, batch_size=N, seed=0, prefetch=0, buffer=24) as ds:
        (y,) = served(ds, 1)
    assert sorted(y) == list(range(N)) and not np.array_equal(y, np.arange(N))
    chunks = y // CHUNK
    assert len(set(chunks[:16])) >= 2  # a window mixes blocks ...
    assert set(chunks[:24]) != {0, 1, 2}  # ... drawn from the whole shard
    assert all(len(set(chunks[i:i + 24])) <= 6 for i in range(N - 24))  # two windows at most


@pytest.mark.parametrize("buffer", [6, 20, 1000])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_gives_the_following_batches(chunked, buffer, prefetch):
    kwargs = dict(shard_index=0, num_shards=1, batch_size=5, seed=7, prefetch=prefetch,
                  buffer=buffer)
    with ShardedDataset(chunked, **kwargs) as ds:
        served(ds, 27)  # 20 batches an epoch: into the middle of the second
        saved = ds.state()
        assert saved == {"epoch": 1, "cursor": 35}
        expected = served(ds, 30)  # across the next epoch boundary
    with ShardedDataset(chunked, **kwargs) as fresh:
        served(fresh, 3)
        fresh.restore(saved)
        for want, got in zip(expected, served(fresh, 30)):
            np.testing.assert_array_equal(got, want)
        assert fresh.peak_rows_held <= buffer


def test_the_buffer_is_checked_with_one_message(chunked, monkeypatch):
    for bad in (0, -4, 2.5, True, "8"):
        with pytest.raises(ConfigurationError,
                           match=r"shuffle buffer must be a number of samples >= 1, got"):
            ShardedDataset(chunked, batch_size=2, buffer=bad)
    monkeypatch.setenv(BUFFER_ENV, "-1")
    with pytest.raises(ConfigurationError, match=r"\$MPITF_DATA_BUFFER_MIB='-1'.* > 0"):
        ShardedDataset(chunked, batch_size=2)
    monkeypatch.setenv(BUFFER_ENV, "0.5")  # MiB: 512 KiB of 16-byte rows
    assert buffer_rows(None, 16) == 32768
    monkeypatch.delenv(BUFFER_ENV)
    assert buffer_rows(None, 16) == (64 << 20) // 16


def test_converters_write_chunks_that_streaming_reads_whole(tmp_path):
    path = str(tmp_path / "d.h5")
    x = np.arange(3000 * 200, dtype=np.float32).reshape(3000, 200)
    write_dataset(path, x, np.arange(3000) % 10, x[:7], np.arange(7), name="t", num_classes=10,
                  image_shape=(200, 1, 1), compression="lzf")
    rows = chunk_rows(200 * 4 + 8, 3000)
    assert rows == 1024 and chunk_rows(24, 3000) == 3000  # ~1 MiB of rows, at most the split
    with h5py.File(path) as f:
        assert f["x_train"].chunks == (rows, 200) and f["y_train"].chunks == (rows,)
        assert f["x_train"].compression == "lzf" and f["x_test"].chunks == (7, 200)
    order = x[epoch_order(0, 3000, rows, 1, 0, 0, 2 * rows)]
    for prefetch in (0, 2):
        with ShardedDataset(path, batch_size=100, seed=1, buffer=2 * rows,
                            prefetch=prefetch) as ds:
            got = np.concatenate([ds.next_batch()[0] for _ in range(30)])
            # Windows of half the buffer, here one chunk of each array (three windows);
            # prefetching reads the next window while serving one: the two fit the buffer.
            assert ds.peak_rows_held <= 2 * rows
            if prefetch:
                assert ds._reader.windows_read_ahead >= 2  # windows 1 and 2 at least
            else:
                assert ds.peak_rows_held == rows and ds._reader.windows_read_ahead == 0
        np.testing.assert_array_equal(got, order)
    write_dataset(path, x, np.arange(3000), x[:7], np.arange(7), name="t", num_classes=10,
                  image_shape=(200, 1, 1))
    with h5py.File(path) as f:
        assert f["x_train"].compression is None  # off by default
    with pytest.raises(ConfigurationError, match="unknown compression 'zip'"):
        write_dataset(path, x, np.arange(3000), x[:7], np.arange(7), name="t", num_classes=10,
                      image_shape=(200, 1, 1), compression="zip")
