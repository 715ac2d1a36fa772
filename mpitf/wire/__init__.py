"""What travels between workers and ps tasks, and how it reaches MPI.

Holds ``protocol`` (header, kinds, tags, flags, waits with deadlines), ``frames``
(a frame as MPI sees it: direct, or staged through pinned memory in chunks) and
``layout`` (where each ps's frame and each variable sit in a worker's flat buffer).

May import: ``mpitf.runtime`` and the spec layer.
"""
