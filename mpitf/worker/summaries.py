"""TensorBoard event files (TF's ``FileWriter``): scalars and histograms, via tensorboardX.

The one module that imports tensorboardX, and only when the first event is written, so a
rank that writes none (every rank but the chief) never loads it. tensorboardX builds the
protocol buffers and writes the records; a histogram is counted where its array lives
(numpy, or CuPy on its GPU), so only the counts and five numbers cross to the host.
"""

import itertools
import math
import os
import sys
import time

import numpy as np

from ..runtime.backend import array_module

__all__ = ["HISTOGRAM_BUCKETS", "EventWriter", "histogram_stats"]

HISTOGRAM_BUCKETS = 30  # equal-width buckets from min to max: tf.summary.histogram's default
_files = itertools.count()  # an event file's name has the second it was opened: make it unique


def histogram_stats(values, buckets=HISTOGRAM_BUCKETS):
    """Return the histogram of ``values`` as TensorBoard's ``HistogramProto`` fields (a dict).

    ``values`` is a numpy or CuPy array, read in place (a contiguous variable through a
    view). ``buckets`` equal-width buckets span min to max, each given by its right edge as
    TensorBoard reads them; NaN and Inf count in ``num`` but in no bucket.
    """
    xp = array_module(values)
    flat = values.reshape(-1)
    lo, hi = float(flat.min()), float(flat.max())
    with np.errstate(over="ignore", invalid="ignore"):  # a diverged variable: inf is the truth
        squares = float(xp.dot(flat, flat))
    total = float(flat.sum(dtype=np.float64))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        flat = flat[xp.isfinite(flat)]  # a copy, only for a variable that holds NaN or Inf
        lo, hi = (float(flat.min()), float(flat.max())) if flat.size else (0.0, 0.0)
    width = (hi - lo) / buckets
    if width > 0:
        counts = xp.histogram(flat, bins=buckets, range=(lo, hi))[0]
        counts = counts if xp is np else counts.get()
        limits = np.linspace(lo, hi, buckets + 1)[1:].tolist()  # np.histogram's edges
    else:  # every value equal (or none finite): one bucket
        counts, limits = [int(flat.size)], [hi]
    return dict(min=lo, max=hi, num=int(values.size), sum=total, sum_squares=squares,
                bucket_limits=limits, bucket_counts=[int(c) for c in counts])


class EventWriter:
    """Write TensorBoard events into ``logdir``; nothing is created before the first event.

    Each call writes one event holding every value of its mapping, in this thread (no
    queue, no thread of its own). A flush syncs the file to disk (milliseconds on a busy
    file system), so writes flush at most every ``flush_secs``, the first at once; call
    :meth:`flush` to force one and :meth:`close` at the end. TensorBoard reads every event
    file of a directory, so a resumed run adds its own file beside the earlier ones (named
    with the process id and a count, so no two writers share one); ``tensorboard --logdir
    DIR`` shows each directory under DIR as a run.

    Args:
        logdir: the directory of the event files (made on the first write).
        flush_secs: the longest time a written event waits before it is flushed (as long
            as writes go on).
    """

    def __init__(self, logdir, flush_secs=5.0):
        self.logdir = os.fspath(logdir)
        self.flush_secs = flush_secs
        self._writer = None
        self._flushed = -math.inf

    def load(self):
        """Import tensorboardX now, creating nothing.

        tensorboardX imports torch where it is installed (2 s on an idle core) only for its
        SummaryWriter's type checks; this writer hands it no tensor, so torch stays hidden
        during the import unless it is loaded already. A training chief loads it while it
        builds its hooks, before the workers agree where to start: the others wait for it
        there, instead of training ahead in async mode.
        """
        hide = "torch" not in sys.modules
        if hide:
            sys.modules["torch"] = None  # `import torch` raises ImportError meanwhile
        try:
            from tensorboardX.event_file_writer import EventsWriter  # noqa: F401
            from tensorboardX.proto import event_pb2, summary_pb2  # noqa: F401
        finally:
            if hide:
                del sys.modules["torch"]

    def open(self):
        """Load tensorboardX and open the event file now (else at the first write).

        A training chief opens it before its first step: inside the step loop the import
        would stall a step and make its gradients stale in async mode.
        """
        if self._writer is None:
            self.load()
            from tensorboardX.event_file_writer import EventsWriter

            os.makedirs(self.logdir, exist_ok=True)
            self._writer = EventsWriter(os.path.join(self.logdir, "events"),
                                        f".{os.getpid()}.{next(_files)}")

    def _write(self, step, values):
        self.open()
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        self._writer.write_event(Event(wall_time=time.time(), step=int(step),
                                       summary=Summary(value=values)))
        if time.monotonic() - self._flushed >= self.flush_secs:
            self.flush()

    def scalars(self, step, mapping):
        """Write each ``tag: number`` of ``mapping`` at global step ``step``."""
        from tensorboardX.proto.summary_pb2 import Summary

        self._write(step, [Summary.Value(tag=tag, simple_value=float(v))
                           for tag, v in mapping.items()])

    def histograms(self, step, mapping):
        """Write a histogram of each ``tag: array`` of ``mapping`` at global step ``step``."""
        from tensorboardX.summary import histogram_raw

        self._write(step, [histogram_raw(tag, **histogram_stats(v)).value[0]
                           for tag, v in mapping.items()])

    def flush(self):
        """Write what was given so far to disk."""
        if self._writer is not None:
            self._writer.flush()
        self._flushed = time.monotonic()

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
