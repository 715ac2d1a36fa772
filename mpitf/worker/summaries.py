"""TensorBoard event files (TF's ``FileWriter``): scalars and histograms, via tensorboardX.

The one module that imports tensorboardX, and only when the first event is written, so a
rank that writes none (every rank but the chief) never loads it. Histograms are counted
where the array lives (numpy, or CuPy on its GPU) into TensorFlow's default buckets; only
the counts and five numbers cross to the host, and tensorboardX encodes the event.
"""

import os
import sys

import numpy as np

from ..runtime.backend import array_module

__all__ = ["EventWriter", "histogram_stats"]


def _tf_bucket_limits():
    """Return TensorFlow's default histogram edges: ±1e-12 growing by 10 % to 1e20, 0, ±max."""
    positive = [1e-12]
    while positive[-1] < 1e20:
        positive.append(positive[-1] * 1.1)
    big = sys.float_info.max
    return np.array([-big, *(-v for v in reversed(positive)), 0.0, *positive, big])


_EDGES = _tf_bucket_limits()
_edges_on = {}  # array module -> the edges there (one copy per device kind)


def histogram_stats(values):
    """Return the histogram of ``values`` as ``add_histogram_raw`` takes it (a dict).

    ``values`` is any numpy or CuPy array; it is counted in place (a contiguous variable is
    read through a view). The buckets are TensorFlow's, trimmed to the occupied range with
    one empty bucket on the left, as TensorBoard draws them.
    """
    xp = array_module(values)
    flat = values.reshape(-1)
    edges = _edges_on.get(xp)
    if edges is None:
        edges = _edges_on[xp] = _EDGES if xp is np else xp.asarray(_EDGES)
    counts = xp.histogram(flat, bins=edges)[0]
    counts = counts.get() if xp is not np else counts
    occupied = np.flatnonzero(counts)
    if occupied.size:
        start, end = int(occupied[0]), int(occupied[-1]) + 1
    else:  # nothing finite to count
        start = end = len(counts)
    bucket = counts[max(start - 1, 0):end]
    limit = _EDGES[max(start, 1):end + 1]
    if start == 0:  # keep an empty bucket on the left, so the first one has a left edge
        bucket = np.concatenate([[0], bucket])
        limit = np.concatenate([_EDGES[:1], limit])
    with np.errstate(over="ignore", invalid="ignore"):  # a diverged variable: inf is the truth
        squares = float(xp.dot(flat, flat))
    return dict(min=float(flat.min()), max=float(flat.max()), num=int(flat.size),
                sum=float(flat.sum(dtype=np.float64)), sum_squares=squares,
                bucket_limits=limit.tolist(), bucket_counts=bucket.tolist())


class EventWriter:
    """Write TensorBoard events into ``logdir``; nothing is created before the first event.

    TensorBoard reads every event file of a directory, so a resumed run adds its own file
    beside the earlier ones (named with this process's id, so two runs never share one).
    ``tensorboard --logdir DIR`` shows each directory under DIR as a run.

    Args:
        logdir: the directory of the event files (made on the first write).
        flush_secs: events still queued are written at least this often (and at
            :meth:`flush` and :meth:`close`).
    """

    def __init__(self, logdir, flush_secs=30):
        self.logdir = os.fspath(logdir)
        self.flush_secs = flush_secs
        self._writer = None

    def _open(self):
        if self._writer is None:
            from tensorboardX import SummaryWriter

            os.makedirs(self.logdir, exist_ok=True)
            self._writer = SummaryWriter(self.logdir, flush_secs=self.flush_secs,
                                         filename_suffix=f".{os.getpid()}")
        return self._writer

    def scalars(self, step, mapping):
        """Write each ``tag: number`` of ``mapping`` at global step ``step``."""
        writer = self._open()
        for tag, value in mapping.items():
            writer.add_scalar(tag, float(value), int(step))

    def histograms(self, step, mapping):
        """Write a histogram of each ``tag: array`` of ``mapping`` at global step ``step``."""
        writer = self._open()
        for tag, values in mapping.items():
            writer.add_histogram_raw(tag, global_step=int(step), **histogram_stats(values))

    def flush(self):
        """Write the queued events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self):
        """Flush and close the event file (a later write opens a new one)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
