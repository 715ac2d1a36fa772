"""The ps's pool of kernel threads: one chunk of the shard per thread, started once.

A fused kernel (:mod:`mpitf.ps.kernels`) releases the GIL, so ``threads`` chunks of a
buffer are updated at once: the caller runs chunk 0 and ``threads - 1`` threads, made at
ps start-up, run the others. Chunks are whole cache lines, computed once per buffer size
and kept; a buffer too small to be worth waking threads for runs on the caller alone. The
kernels are elementwise, so how a buffer is cut never changes a bit of the result.
"""

import os
import threading

__all__ = ["KernelPool", "default_threads"]

_ALIGN = 16  # elements: a 64-byte cache line of float32, so no two threads share a line
MIN_CHUNK = 1 << 15  # elements per thread below which one thread does the whole buffer


def default_threads(hosts=None, roles=None, rank=None):
    """Return the cores this ps rank may use, shared among the ps ranks on its node.

    ``len(os.sched_getaffinity(0))`` divided by the number of ps ranks on this rank's host
    (from ``hosts`` and ``roles``, a server's lists per rank, when given), at least 1.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    if hosts is not None and roles is not None and rank is not None:
        here = hosts[rank]
        sharing = sum(1 for h, (job, _) in zip(hosts, roles) if h == here and job == "ps")
        cores //= max(1, sharing)
    return max(1, cores)


class KernelPool:
    """Run a chunked kernel over ``threads`` threads; ``run`` returns when every chunk is done.

    Args:
        threads: the threads that update a buffer, the caller's included (1: no threads).
        min_chunk: elements per thread below which fewer threads take part.
    """

    def __init__(self, threads, min_chunk=MIN_CHUNK):
        self.threads = int(threads)
        self.min_chunk = int(min_chunk)
        self._bounds = {}  # buffer size -> chunk boundaries
        self._job = None
        self._errors = [None] * self.threads
        self._closed = False
        self._workers = []
        if self.threads > 1:
            self._start = threading.Barrier(self.threads)
            self._end = threading.Barrier(self.threads)
            for index in range(1, self.threads):
                t = threading.Thread(target=self._serve, args=(index,), daemon=True,
                                     name=f"mpitf-kernel-{index}")
                t.start()
                self._workers.append(t)

    def bounds(self, n):
        """Return the chunk boundaries of a buffer of ``n`` elements (made once per ``n``)."""
        b = self._bounds.get(n)
        if b is None:
            parts = max(1, min(self.threads, n // self.min_chunk))
            cuts = [min(n, (n * i // parts + _ALIGN - 1) // _ALIGN * _ALIGN)
                    for i in range(parts)]
            b = self._bounds[n] = tuple(cuts) + (n,)
        return b

    def run(self, kernel, n, args):
        """Call ``kernel(lo, hi, *args)`` on every chunk of ``[0, n)``; re-raise any error."""
        if self.threads == 1 or n < 2 * self.min_chunk:
            kernel(0, n, *args)
            return
        b = self.bounds(n)
        self._job = (kernel, b, args)
        self._start.wait()
        try:
            kernel(b[0], b[1], *args)
        finally:
            self._end.wait()
            self._job = None
        for i, err in enumerate(self._errors):
            if err is not None:
                self._errors[i] = None
                raise err

    def _serve(self, index):
        while True:
            self._start.wait()
            if self._closed:
                return
            kernel, b, args = self._job
            try:
                if index + 1 < len(b):
                    kernel(b[index], b[index + 1], *args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                self._errors[index] = exc
            self._end.wait()

    def close(self):
        """Stop the threads (the pool runs everything on the caller afterwards)."""
        if self.threads > 1 and not self._closed:
            self._closed = True
            self._start.wait()
            for t in self._workers:
                t.join()
            self.threads = 1
