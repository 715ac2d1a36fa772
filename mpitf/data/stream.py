"""A worker's rows of an HDF5 split, read in chunk-aligned blocks through a bounded buffer.

The shard (rows ``[start, stop)`` of row-aligned arrays) is cut into blocks along the
file's chunk grid. An epoch shuffles the blocks by ``(seed, epoch, shard)`` and packs them,
in that order, into windows of at most half the ``buffer`` rows; a window is read whole, its
rows are shuffled by ``(seed, epoch, shard, window)`` and served, while a reader thread reads
the next window into the other half (when batches are prefetched). The epoch's order is a
pure function of those numbers and the buffer, so a position ``(epoch, cursor)`` names the
next batch exactly and a resumed job sees the very batches it would have seen. A buffer that
holds the whole shard is the one-window case: the plain shuffle
``default_rng((seed, epoch, shard)).permutation(n)`` over rows read once.
"""

import bisect
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy

from ..errors import ConfigurationError, DataError

__all__ = ["BUFFER_ENV", "DEFAULT_BUFFER_MIB", "ShardReader", "buffer_rows", "epoch_order"]

DEFAULT_BUFFER_MIB = 64
BUFFER_ENV = "MPITF_DATA_BUFFER_MIB"  # the default buffer, in MiB, for every job's readers
BLOCKS_PER_BUFFER = 16  # blocks of an unchunked array: a window mixes at least this many


def buffer_rows(buffer, row_bytes):
    """Return the shuffle buffer in rows: ``buffer`` itself, else the default MiB in rows.

    The default is ``$MPITF_DATA_BUFFER_MIB`` MiB, else 64 MiB, of rows of ``row_bytes``.
    """
    if buffer is None:
        text = os.environ.get(BUFFER_ENV, str(DEFAULT_BUFFER_MIB))
        try:
            mib = float(text)
        except ValueError:
            mib = -1.0
        if not mib > 0:
            raise ConfigurationError(f"${BUFFER_ENV}={text!r}: expecting the shuffle buffer "
                                     "in MiB, a number > 0")
        return max(1, int(mib * (1 << 20)) // max(1, int(row_bytes)))
    if isinstance(buffer, bool) or not isinstance(buffer, (int, numpy.integer)) or buffer < 1:
        raise ConfigurationError(
            f"shuffle buffer must be a number of samples >= 1, got {buffer!r} (it bounds the "
            f"rows a worker holds; default: {DEFAULT_BUFFER_MIB} MiB of rows)")
    return int(buffer)


def cut_blocks(start, stop, chunk):
    """Return the ``(lo, hi)`` row ranges of ``[start, stop)`` cut along a grid of ``chunk``."""
    edges = numpy.arange((start // chunk + 1) * chunk, stop, chunk, dtype=numpy.int64)
    bounds = numpy.concatenate([[start], edges, [stop]]).astype(numpy.int64)
    return numpy.stack([bounds[:-1], bounds[1:]], axis=1)


class _Plan:
    """One epoch's windows: ``blocks`` in reading order, ``first`` block and ``rows`` offset."""

    def __init__(self, blocks, seed, epoch, shard, buffer):
        self.key = (seed, epoch, shard)
        n = int((blocks[:, 1] - blocks[:, 0]).sum())
        self.single = n <= buffer
        if self.single:  # the whole shard in one window, rows in file order
            self.blocks, self.first, self.rows = blocks, [0, len(blocks)], [0, n]
            return
        self.blocks = blocks[numpy.random.default_rng(self.key).permutation(len(blocks))]
        self.first, self.rows, held = [0], [0], 0
        limit = window_limit(buffer)
        for i, size in enumerate(self.blocks[:, 1] - self.blocks[:, 0]):
            if held and held + size > limit:
                self.first.append(i)
                self.rows.append(self.rows[-1] + held)
                held = 0
            held += int(size)
        self.first.append(len(self.blocks))
        self.rows.append(n)

    def window_rng(self, w):
        """Return window ``w``'s generator: (seed, epoch, shard), with ``w`` when there are more."""
        return numpy.random.default_rng(self.key if self.single else (*self.key, w))

    def window_key(self, w):
        """Return what names window ``w``'s rows: the same every epoch for the whole shard."""
        return "shard" if self.single else (self.key[1], w)

    def window_of(self, pos):
        return bisect.bisect_right(self.rows, pos) - 1


def window_limit(buffer):
    """Return the most rows of a window when the shard does not fit: half the buffer."""
    return max(1, buffer // 2)


def block_rows(chunk, buffer):
    """Return the rows of a block: the file's ``chunk`` (None: unchunked) within a window."""
    return min(window_limit(buffer), chunk or max(1, buffer // BLOCKS_PER_BUFFER))


def epoch_order(start, stop, chunk, seed, epoch, shard, buffer):
    """Return the file rows of one epoch in serving order (the reference the reader follows).

    ``chunk``: the rows per chunk of the file's arrays (None: unchunked).
    """
    plan = _Plan(cut_blocks(start, stop, block_rows(chunk, buffer)), seed, epoch, shard, buffer)
    out = []
    for w in range(len(plan.first) - 1):
        rows = numpy.concatenate([numpy.arange(lo, hi) for lo, hi in
                                  plan.blocks[plan.first[w]:plan.first[w + 1]]])
        out.append(rows[plan.window_rng(w).permutation(len(rows))])
    return numpy.concatenate(out)


class _Window:
    """The rows of one window as read (the buffer) and their serving order in ``epoch``."""

    def __init__(self, key, epoch, arrays, perm):
        self.key, self.epoch, self.arrays, self.perm = key, epoch, arrays, perm


class ShardReader:
    """Batches of rows ``[start, stop)`` of ``datasets`` (open h5py arrays of one file).

    ``prepare(arrays, file_rows)`` turns a window's arrays as read into those served (a
    reshape, a cast, a check that raises DataError); ``file_rows(i)`` is the file's row of
    window row ``i``. ``rows_held`` counts the rows in the buffer now, ``peak_rows_held``
    the most it ever held (never more than ``buffer``), ``rows_read`` the rows read so far,
    ``windows_read_ahead`` the windows a reader thread was asked to read ahead.
    """

    def __init__(self, path, datasets, start, stop, batch_size, seed, shard, buffer,
                 drop_remainder=True, prepare=None):
        self.path, self.datasets = path, datasets
        self.start, self.stop, self.num_samples = int(start), int(stop), int(stop - start)
        self.batch_size, self.seed, self.shard = int(batch_size), seed, int(shard)
        row_bytes = sum(d.dtype.itemsize * int(numpy.prod(d.shape[1:])) for _, d in datasets)
        self.buffer = buffer_rows(buffer, row_bytes)
        self.drop_remainder, self.prepare = drop_remainder, prepare
        chunks = [d.chunks[0] for _, d in datasets if d.chunks]
        self.chunk = block_rows(chunks[0] if chunks else None, self.buffer)
        self.blocks = cut_blocks(self.start, self.stop, self.chunk)
        self.rows_held = self.peak_rows_held = self.rows_read = self.windows_read_ahead = 0
        self._counting = threading.Lock()  # the reader thread counts too

    def normalize(self, epoch, cursor):
        """Return the position of the next batch: roll over when the epoch is used up."""
        left = self.num_samples - cursor
        if left <= 0 or (self.drop_remainder and left < self.batch_size):
            return epoch + 1, 0
        return epoch, cursor

    def batch_at(self, epoch, cursor, cache):
        """Return ``(*arrays, next_epoch, next_cursor)`` for the batch at a normal position.

        ``cache`` (a dict owned by the caller, one per reading thread) keeps the epoch's plan
        and the window in the buffer; a batch may span windows.
        """
        if cache.get("epoch") != epoch:
            cache["epoch"], cache["plan"] = epoch, _Plan(self.blocks, self.seed, epoch,
                                                         self.shard, self.buffer)
        plan = cache["plan"]
        end = min(cursor + self.batch_size, self.num_samples)
        parts, pos = [], cursor
        while pos < end:
            w = plan.window_of(pos)
            win = cache.get("window")
            if win is None or win.key != plan.window_key(w):
                self.release(cache)
                cache["window"] = win = self._take(cache, plan, w)
                self._read_ahead(cache, plan, w)
            if win.epoch != epoch:  # the whole shard, read once: a new order each epoch
                win.epoch, win.perm = epoch, plan.window_rng(w).permutation(len(win.perm))
            lo, hi = pos - plan.rows[w], min(end, plan.rows[w + 1]) - plan.rows[w]
            parts.append([a[win.perm[lo:hi]] for a in win.arrays])
            pos += hi - lo
        batch = parts[0] if len(parts) == 1 else [numpy.concatenate(p) for p in zip(*parts)]
        return (*batch, *self.normalize(epoch, end))

    def release(self, cache):
        """Drop the window ``cache`` holds, so the next one fits the buffer."""
        win = cache.pop("window", None)
        if win is not None:
            self._count(-len(win.perm))

    def close(self, cache):
        """Drop everything ``cache`` holds, the window read ahead included, and its reader."""
        self.release(cache)
        ahead, pool = cache.pop("ahead", None), cache.pop("pool", None)
        if ahead is not None:
            try:
                self._count(-len(ahead[1].result().perm))
            except Exception:  # noqa: BLE001  (a failed read holds nothing; its error is moot)
                pass
        if pool is not None:
            pool.shutdown()

    def _count(self, rows):
        with self._counting:
            self.rows_held += rows
            self.rows_read += max(rows, 0)
            self.peak_rows_held = max(self.peak_rows_held, self.rows_held)

    def _take(self, cache, plan, w):
        """Return window ``w``: the one read ahead when it is that one, else read it now."""
        ahead = cache.pop("ahead", None)
        if ahead is not None:
            key, future = ahead
            win = future.result()  # the reader's error, if any, is raised here
            if key == plan.window_key(w):
                return win
            self._count(-len(win.perm))
        return self._load(plan, w)

    def _read_ahead(self, cache, plan, w):
        """Start reading the window after ``w`` (in this epoch or the next) on the reader.

        Only where ``cache["read_ahead"]`` (a prefetching producer) and both fit the buffer.
        """
        if not cache.get("read_ahead") or plan.single or 2 * window_limit(self.buffer) > \
                self.buffer:
            return
        if w + 2 < len(plan.first):
            plan, w = plan, w + 1
        else:
            plan, w = _Plan(self.blocks, self.seed, plan.key[1] + 1, self.shard, self.buffer), 0
        if "pool" not in cache:
            cache["pool"] = ThreadPoolExecutor(1, thread_name_prefix="mpitf-read")
        cache["ahead"] = (plan.window_key(w), cache["pool"].submit(self._load, plan, w))
        self.windows_read_ahead += 1

    def _load(self, plan, w):
        """Read window ``w`` of ``plan`` into fresh arrays, blocks in file order."""
        blocks = plan.blocks[plan.first[w]:plan.first[w + 1]]
        sizes = blocks[:, 1] - blocks[:, 0]
        offsets = numpy.concatenate([[0], numpy.cumsum(sizes)])
        rows = int(offsets[-1])
        self._count(rows)  # held from here: the arrays are allocated before they are read
        try:
            arrays = [self._read(name, d, blocks, offsets, rows) for name, d in self.datasets]
            if self.prepare is not None:
                def file_rows(i):
                    b = int(numpy.searchsorted(offsets, i, side="right")) - 1
                    return int(blocks[b, 0] + i - offsets[b])

                arrays = self.prepare(arrays, file_rows)
        except BaseException:
            self._count(-rows)
            raise
        return _Window(plan.window_key(w), plan.key[1], arrays,
                       plan.window_rng(w).permutation(rows))

    def _read(self, name, d, blocks, offsets, rows):
        """Read ``blocks`` of array ``d`` into one array, block ``j`` at ``offsets[j]``."""
        out = numpy.empty((rows, *d.shape[1:]), d.dtype)
        for j in numpy.argsort(blocks[:, 0], kind="stable") if out.size else ():
            lo, hi = (int(v) for v in blocks[j])
            try:
                out[offsets[j]:offsets[j + 1]] = d[lo:hi]  # one chunk: faster than read_direct
            except (OSError, RuntimeError, TypeError, ValueError) as exc:
                raise DataError(f"data file {self.path}: cannot read {name}[{lo}:{hi}]: "
                                f"{exc}") from None
        return out
