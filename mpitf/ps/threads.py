"""The ps's pool of kernel threads: one chunk of the shard per thread, started once.

A fused kernel (:mod:`mpitf.ps.kernels`) releases the GIL, so ``threads`` chunks of a
buffer are updated at once: the caller runs chunk 0 and ``threads - 1`` threads, made at
ps start-up, run the others. Chunks are whole cache lines, computed once per buffer size
and kept; a buffer too small to be worth waking threads for runs on the caller alone. The
kernels are elementwise, so how a buffer is cut never changes a bit of the result.
"""

import threading

from ..runtime.cores import node_share, ranks_on_host, usable_cores

__all__ = ["KernelPool", "default_threads"]

_ALIGN = 16  # elements: a 64-byte cache line of float32, so no two threads share a line
MIN_CHUNK = 1 << 18  # elements (1 MiB of float32) per thread below which fewer threads help


def default_threads(hosts=None, rank=None):
    """Return the cores this ps rank may use, shared among the ranks on its node.

    The usable cores divided by the number of ranks on this rank's host (from ``hosts``, a
    server's host per rank, when given), at least 1 (:mod:`mpitf.runtime.cores`). Every rank counts,
    workers too: a worker waiting on its ps spins in MPI, so kernel threads beyond the
    node's share only take turns with it (on 2 cores, 1 ps + 2 workers, 2 kernel threads
    made small async steps slower and staler).
    """
    if hosts is None or rank is None:
        return usable_cores()
    return node_share(ranks_on_host(hosts, rank))


class KernelPool:
    """Run a chunked kernel over ``threads`` threads; ``run`` returns when every chunk is done.

    Each thread waits on a lock of its own (a C lock, released from the caller's thread), so
    starting and joining a chunk is two lock hand-offs, not Python-level conditions.

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
        self._workers = []
        for index in range(1, self.threads):
            go, done = threading.Lock(), threading.Lock()
            go.acquire()
            done.acquire()
            t = threading.Thread(target=self._serve, args=(index, go, done), daemon=True,
                                 name=f"mpitf-kernel-{index}")
            t.start()
            self._workers.append((t, go, done))

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
        helpers = self._workers[:len(b) - 2]  # the caller takes chunk 0
        self._job = (kernel, b, args)
        for _, go, _ in helpers:
            go.release()
        try:
            kernel(b[0], b[1], *args)
        finally:
            for _, _, done in helpers:
                done.acquire()
            self._job = None
        for i, err in enumerate(self._errors):
            if err is not None:
                self._errors[i] = None
                raise err

    def _serve(self, index, go, done):
        while True:
            go.acquire()
            if self._job is None:  # close()
                return
            kernel, b, args = self._job
            try:
                kernel(b[index], b[index + 1], *args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                self._errors[index] = exc
            done.release()

    def close(self):
        """Stop the threads (the pool runs everything on the caller afterwards)."""
        workers, self._workers, self.threads = self._workers, [], 1
        self._job = None
        for _, go, _ in workers:
            go.release()
        for t, _, _ in workers:
            t.join()
