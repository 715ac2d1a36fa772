"""Batches of one worker's shard, served forever from a position that names the next one.

:class:`ShardBatches` serves what a :class:`~mpitf.data.stream.ShardReader` reads: the
position ``(epoch, cursor)`` (saved in checkpoints), ``restore``, and prefetch on a
background thread that also does the reading. :class:`~mpitf.data.sharded.ShardedDataset`
(features and labels) and :class:`~mpitf.data.ctr.CtrDataset` (ids, dense, labels) are it
over their own arrays.
"""

import queue
import threading

from ..config import check_int
from ..errors import ConfigurationError

__all__ = ["ShardBatches"]


class _Failure:
    """Carries an exception raised in the prefetch thread to the consumer."""

    def __init__(self, exc):
        self.exc = exc


class ShardBatches:
    """Serve ``reader``'s batches from position (0, 0), ``prefetch`` of them ahead.

    ``file`` (an open h5py file, or None) is closed with the batches.
    """

    def __init__(self, reader, prefetch=2, file=None):
        check_int("prefetch", prefetch, 0)
        self._reader, self.prefetch, self._file = reader, int(prefetch), file
        self.buffer = reader.buffer
        self._epoch, self._cursor = 0, 0
        self._cache = {}  # the plan and window of synchronous mode
        self._thread = None
        self._stop = None
        self._queue = None
        self._closed = False

    @property
    def rows_held(self):
        """Rows of the shard in the shuffle buffer now."""
        return self._reader.rows_held

    @property
    def rows_read(self):
        """Rows read from the file so far: a shard that fits the buffer is read once."""
        return self._reader.rows_read

    @property
    def peak_rows_held(self):
        """The most rows the shuffle buffer has held at once."""
        return self._reader.peak_rows_held

    # --- positions -----------------------------------------------------------

    def _normalize(self, epoch, cursor):
        """Return the position of the next batch: roll over when the epoch is used up."""
        return self._reader.normalize(epoch, cursor)

    def _batch_at(self, epoch, cursor, cache):
        """Return ``(*arrays, next_epoch, next_cursor)`` for the batch at a normalized position.

        ``cache`` holds the epoch's plan and the window in the buffer; one per reading thread.
        """
        return self._reader.batch_at(epoch, cursor, cache)

    def state(self):
        """Return ``{"epoch", "cursor"}``: the position of the next batch ``next_batch`` returns."""
        return {"epoch": self._epoch, "cursor": self._cursor}

    def restore(self, state):
        """Reposition so the next batch is the one that followed ``state`` when it was taken.

        Batches prefetched from the old position are dropped.
        """
        try:
            epoch, cursor = int(state["epoch"]), int(state["cursor"])
        except (KeyError, TypeError, ValueError):
            raise ConfigurationError(
                f"data position must be a dict with integer 'epoch' and 'cursor', got {state!r}"
            ) from None
        if epoch < 0 or not 0 <= cursor < self.num_samples:
            raise ConfigurationError(
                f"data position {state!r} out of range for a shard of {self.num_samples} samples"
            )
        self._stop_thread()
        self._epoch, self._cursor = self._normalize(epoch, cursor)

    # --- serving -------------------------------------------------------------

    def next_batch(self):
        """Return the next batch, a tuple of host numpy arrays (``(x, y)`` for features)."""
        if self._closed:
            raise ConfigurationError(f"{type(self).__name__} over {self.path} is closed")
        if self.prefetch == 0:
            *batch, self._epoch, self._cursor = self._batch_at(self._epoch, self._cursor,
                                                               self._cache)
            return tuple(batch)
        if self._thread is None:
            self._reader.release(self._cache)
            self._start_thread()
        item = self._queue.get()
        if isinstance(item, _Failure):
            self._queue.put(item)  # keep failing on later calls instead of blocking
            raise item.exc
        *batch, self._epoch, self._cursor = item
        return tuple(batch)

    def __iter__(self):
        """Yield batches forever."""
        while True:
            yield self.next_batch()

    def _start_thread(self):
        """Start the prefetch thread from the current position."""
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, args=(self._epoch, self._cursor, self._queue, self._stop),
            name=f"mpitf-prefetch-{self.shard_index}", daemon=True,
        )
        self._thread.start()

    def _produce(self, epoch, cursor, q, stop):
        """Fill ``q`` with batches from ``(epoch, cursor)`` until ``stop`` is set."""
        cache = {"read_ahead": True}  # the next window is read while this one is served
        try:
            while not stop.is_set():
                item = self._batch_at(epoch, cursor, cache)
                epoch, cursor = item[-2:]
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # handed to the consumer, which re-raises it
            while not stop.is_set():
                try:
                    q.put(_Failure(exc), timeout=0.05)
                    break
                except queue.Full:
                    continue
        finally:
            self._reader.close(cache)

    def _stop_thread(self):
        """Stop the prefetch thread and drop what it prepared and read."""
        self._reader.release(self._cache)
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread, self._queue, self._stop = None, None, None

    def close(self):
        """Stop prefetching and close the file; later ``next_batch`` calls fail."""
        self._stop_thread()
        self._closed = True
        if self._file is not None:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return (f"{type(self).__name__}({self.path!r}, shard {self.shard_index} of "
                f"{self.num_shards}: samples [{self.start}, {self.stop}), batch_size="
                f"{self.batch_size}, buffer={self.buffer}, position={self.state()})")
