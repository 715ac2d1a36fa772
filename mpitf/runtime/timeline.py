"""Chrome-trace events (compute, push, pull, apply, wait, checkpoint) per rank.

Each rank records spans in memory; at the end they are gathered to rank 0 and written
as one JSON file viewable in Perfetto or chrome://tracing, one track per rank.
"""

import json
import os
import time
from contextlib import contextmanager


class Timeline:
    """Record named spans for one rank; a disabled timeline records nothing and costs nothing."""

    def __init__(self, rank=0, label="", enabled=True):
        self.rank = rank
        self.label = label
        self.enabled = enabled
        self.events = []
        self._t0 = time.perf_counter()
        self._wall0 = time.time()

    @contextmanager
    def span(self, name, **args):
        """Record the time the body takes as an event called ``name``."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter(), **args)

    def add(self, name, start, end, **args):
        """Record an event from perf_counter ``start`` to ``end``."""
        if self.enabled:
            self.events.append({
                "name": name, "ph": "X", "pid": self.rank, "tid": 0,
                "ts": (self._wall0 + start - self._t0) * 1e6, "dur": (end - start) * 1e6,
                "args": args,
            })

    def metadata(self):
        """Return the events naming this rank's track."""
        return [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank} {self.label}".strip()}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]

    def gather_and_write(self, comm, path):
        """Gather every rank's events to rank 0 and write ``path`` there (collective)."""
        everything = comm.gather(self.metadata() + self.events, root=0)
        if comm.Get_rank() == 0 and path:
            merged = [e for events in everything for e in events]
            write_trace(path, merged)
        return everything


def write_trace(path, events):
    """Write a Chrome-trace JSON file atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
